"""What we prefer: YAML policies, layered. A policy never makes an impossible kernel run."""
from .loader import MIXED_GROUP, ON_UNSUPPORTED, VERIFY, PolicyError, PolicyFile, load_default, load_file, parse
from .stack import (PolicyStack, Preference, Selection, SelectionError, Setting, build,
                    parse_selections)

__all__ = ["MIXED_GROUP", "ON_UNSUPPORTED", "PolicyError", "PolicyFile", "PolicyStack",
           "Preference", "Selection", "SelectionError", "Setting", "build", "load_default",
           "load_file", "parse", "parse_selections", "VERIFY"]
