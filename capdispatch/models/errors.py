"""The error of a model or a layout: bad input, so the command line exits 2."""
from __future__ import annotations

from ..errors import BadInput


class ModelError(BadInput):
    """A model that cannot be read, or a layout SGLang would refuse.

    `layouts` holds the layouts that would work (each a `Layout`), empty where the
    error is about the model itself rather than how it is spread over ranks.
    """

    def __init__(self, message: str, layouts=()):
        self.layouts = tuple(layouts)
        super().__init__(message)
