"""What every raysgd package shares: one registry for swappable parts and one argument check.

No dependencies: it imports neither Ray nor torch nor any sibling package, so every package may
import it.
"""

from raysgd_base.checks import WrongTypeError, check_int, check_number, check_option_names
from raysgd_base.registry import (
    Registry,
    accepted_keywords,
    call_with_accepted,
    entry_points,
    normalize_name,
)

__version__ = "0.1.0"
__all__ = [
    "Registry",
    "WrongTypeError",
    "accepted_keywords",
    "call_with_accepted",
    "check_int",
    "check_number",
    "check_option_names",
    "entry_points",
    "normalize_name",
]
