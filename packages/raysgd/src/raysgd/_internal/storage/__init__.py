"""Checkpoints as files: their format (`format`: a file, or a folder of parts with a manifest
written last) and where they are (`location`: a local path or any fsspec URL), written atomically
(`atomic_files`, `direct_writes`); failures as one-line `errors` without credentials. Used by the
driver and the workers alike.
"""
