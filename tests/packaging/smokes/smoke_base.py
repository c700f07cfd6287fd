"""raysgd-base alone: the registry and the argument checks."""

from _smoke import import_every_module, report

from raysgd_base import Registry, WrongTypeError, call_with_accepted, check_int


class Plain:
    def __init__(self, size: int = 1) -> None:
        self.size = size


registry = Registry("widget", "raysgd_smoke.widget", {"plain": Plain})
registry.register("Fancy", lambda size=2, **_: Plain(size * 10))
fancy = call_with_accepted(registry.lookup(" FANCY "), {"size": 3, "device": "cpu"})
plain = call_with_accepted(registry.lookup("plain"), {"size": 4, "device": "cpu"})
try:
    registry.lookup("missing")
    unknown = None
except ValueError as error:
    unknown = str(error)
try:
    check_int("num_workers", 0)
    too_small = None
except ValueError as error:
    too_small = str(error)
try:
    check_int("num_workers", "2")
    wrong_type = None
except WrongTypeError as error:
    wrong_type = [type(error).__name__, isinstance(error, TypeError), isinstance(error, ValueError)]

report(
    "raysgd_base",
    imported=import_every_module("raysgd_base"),
    names=registry.names(),
    fancy=fancy.size,
    plain=plain.size,
    unknown=unknown,
    too_small=too_small,
    wrong_type=wrong_type,
)
