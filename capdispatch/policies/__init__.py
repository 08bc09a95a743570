"""What we prefer: YAML policies, layered. A policy never makes an impossible kernel run."""
from .loader import (MIXED_GROUP, ON_UNSUPPORTED, VERIFY, Bucket, OpPreference, PolicyError,
                     PolicyFile, load_default, load_file, parse)
from .stack import (BucketPreference, PolicyStack, Preference, Selection, SelectionError, Setting,
                    build, parse_selections)

__all__ = ["Bucket", "BucketPreference", "MIXED_GROUP", "ON_UNSUPPORTED", "OpPreference",
           "PolicyError", "PolicyFile", "PolicyStack", "Preference", "Selection", "SelectionError",
           "Setting", "VERIFY", "build", "load_default", "load_file", "parse", "parse_selections"]
