"""The size-bucket dispatcher `bind` returns when a policy gives an op size buckets.

Its only work per call is reading the leading dimension of one tensor argument (the
op's `SizeArg`) and comparing it with a precomputed tuple of bounds. Inside a CUDA
graph the size is static, so the bucket is fixed when the graph is captured.

An entry may be None: "the caller's own kernel" (an engine that keeps its own call for
those sizes, e.g. SGLang's FlashMLA where a bucket's winner is the kernel SGLang calls).
Such a dispatcher cannot run those sizes itself: its caller asks `fn.pick(n)` first
(None: call your own) and calls the dispatcher, or what `pick` gave, for the others.
"""
from __future__ import annotations

from ..errors import ArgumentTypeError


def table(buckets, load):
    """((upper, fn), ...), default fn from BucketResolutions (ascending, the last the
    catch-all). Adjacent buckets with one winner merge; buckets ending in the
    catch-all's winner fold into it. LOAD maps a backend name to its callable (None:
    the caller's own kernel runs those sizes)."""
    default_name = buckets[-1].backend
    rows = []                                    # [upper, name], merged
    for b in buckets[:-1]:
        if rows and rows[-1][1] == b.backend:
            rows[-1][0] = b.upper
        else:
            rows.append([b.upper, b.backend])
    while rows and rows[-1][1] == default_name:
        rows.pop()
    return tuple((u, load(n)) for u, n in rows), load(default_name), \
        tuple((u, n) for u, n in rows) + ((None, default_name),)


def dispatcher(op: str, size, bounds, default, names):
    """A callable that runs the first bucket whose bound holds the size, else DEFAULT.

    SIZE is the op's SizeArg (argument position and name); BOUNDS ((upper, fn), ...)
    ascending; NAMES ((upper, backend), ...) for introspection (`fn.buckets`).
    """
    index, name = size.index, size.name
    keeps = default is None or any(fn is None for _, fn in bounds)

    def pick(n: int):
        """The callable for size N (the leading dimension), None where the caller's own runs."""
        for upper, fn in bounds:
            if n <= upper:
                return fn
        return default

    fns = tuple(fn for _, fn in bounds) + (default,)
    labels = ", ".join(_label(u, n, fn is None) for (u, n), fn in zip(names, fns))

    def own(n):
        raise ArgumentTypeError(f"{op}: size {n} is in a bucket the caller's own kernel runs "
                                f"({labels}); ask pick(n) first")

    def by_keyword(kwargs):
        try:
            return kwargs[name]
        except KeyError:
            raise ArgumentTypeError(f"{op}: missing its size argument {name!r} (position {index}), whose "
                            f"leading dimension picks the size bucket") from None

    if keeps:
        def call(*args, **kwargs):
            try:
                x = args[index]
            except IndexError:
                x = by_keyword(kwargs)
            fn = pick(x.shape[0])
            if fn is None:
                own(x.shape[0])
            return fn(*args, **kwargs)
    elif len(bounds) == 1:                       # the common case: small sizes, then the rest
        (upper, small), = bounds

        def call(*args, **kwargs):
            try:
                x = args[index]
            except IndexError:
                x = by_keyword(kwargs)
            if x.shape[0] <= upper:
                return small(*args, **kwargs)
            return default(*args, **kwargs)
    else:
        def call(*args, **kwargs):
            try:
                x = args[index]
            except IndexError:
                x = by_keyword(kwargs)
            n = x.shape[0]
            for upper, fn in bounds:
                if n <= upper:
                    return fn(*args, **kwargs)
            return default(*args, **kwargs)

    call.__name__ = call.__qualname__ = f"{op}_by_{size.key}"
    call.__doc__ = (f"{op}: the backend for the bucket of {size.key} "
                    f"(leading dimension of {size.name!r}): " +
                    labels)
    call.buckets = names
    call.pick = pick
    call.keeps = keeps
    return call


def _label(upper, backend, own: bool) -> str:
    name = f"{backend} (the caller's own)" if own else backend
    return f"<= {upper}: {name}" if upper is not None else f"else {name}"
