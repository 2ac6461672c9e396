"""The backend's Python runs outside ``torch.compile``.

Why: gloo's collectives are C++, and the compiler never sees them. Ours are Python methods that
torch's C++ calls back into (DDP's reducer broadcasting its rebuilt buckets, a work's ``wait``),
and a call that comes while a compiled function runs eagerly after a graph break starts a
Python frame that Dynamo tries to compile. It sees the process group as an opaque object whose
members are not registered, and a compiled DDP step failed at its second iteration
(``UnsafeScriptObjectError: Member '_world' is not registered``). A collective is nothing a graph
can hold; each entry point runs as plain Python instead (``torch.compiler.disable``, recursive:
whatever it calls too). The cost is one wrapper call per collective, under a microsecond (0.4 us here).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

#: Why a disabled entry point is not compiled (torch prints it when it is asked to trace one).
REASON = "dlcp: a collective of the dlcp backend runs as Python, not in a compiled graph"


def keep_out_of_compile(cls: type, names: Iterable[str]) -> None:
    """Replace each method ``names`` of ``cls`` with one torch's compiler does not trace (nor
    what it calls). Each must be defined on ``cls`` itself: a name that is not fails here, at
    import, rather than leaving an entry point compiled."""
    for name in names:
        if name not in vars(cls):
            raise AttributeError(f"{cls.__name__}.{name} is not defined on the class; nothing to keep out of compile")
        setattr(cls, name, torch.compiler.disable(vars(cls)[name], reason=REASON))


def kept_out(fn: object) -> bool:
    """Whether ``fn`` (a method got from a class or an object) is one torch's compiler skips."""
    return bool(getattr(fn, "_torchdynamo_disable", False))
