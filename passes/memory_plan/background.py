"""The background: bytes held at each planning step by everything the plan does not place.

Replays the events ``_compat.inductor_pools.wrapper_events`` reads from Inductor's wrapper
lines, tracking which names keep which storage alive: outputs from their allocation on; the
inputs a backward may free (saved activations AOTAutograd donates, incoming gradients
``tangents_*``) until their last name is deleted, or for ever if the caller keeps them;
storage that extern kernels allocate themselves (fallback ops, multi-output ops) until their
last name, tuple element or alias is deleted.  A step is one run of allocation lines and the
kernels after it; its value is the most held at one of its kernels (memory peaks while
kernels run).  Extern kernels may also allocate temporaries that no line shows: their steps
are flagged volatile.
"""

from __future__ import annotations

from collections.abc import Sequence

# The events of allocation lines; a run of them starts a step.
ALLOCATION_EVENTS = frozenset({"alloc", "reuse", "alias", "release", "plan"})


def background_bytes(inputs: Sequence[tuple[str, int]], events: Sequence[tuple],
                     caller_keeps_inputs: bool) -> tuple[list[int], list[bool]]:
    """Bytes held at each step (``0 .. last step``) by all but the planned buffers, and
    whether a kernel of the step is an extern kernel that allocates its outputs.

    ``inputs``: the graph's inputs it may free, ``(name, bytes)``; ``caller_keeps_inputs``:
    the caller holds them to the end (``retain_graph=True``, gradients it keeps).
    """
    size: dict[int, int] = {}
    refs: dict[int, int] = {}
    held: dict[str, list[int]] = {}
    pending: dict[str, int] = {}          # multi-output element name -> its storage
    live = 0

    def new(name, nbytes):
        nonlocal live
        sid = len(size)
        size[sid], refs[sid] = nbytes, 0
        live += nbytes
        hold(name, [sid])
        return sid

    def hold(name, sids):
        for sid in sids:
            refs[sid] += 1
        held.setdefault(name, []).extend(sids)

    def drop(name):
        nonlocal live
        for sid in held.pop(name, ()):
            refs[sid] -= 1
            if refs[sid] == 0:
                live -= size[sid]

    for name, nbytes in inputs:
        sid = new(name, nbytes)
        if caller_keeps_inputs:
            refs[sid] += 1  # the caller's own reference: never released
    background, volatile = [live], [False]
    in_run = False
    for kind, *args in events:
        if kind in ALLOCATION_EVENTS:
            if not in_run:  # a new step: its value is taken at its kernels
                background.append(0)
                volatile.append(False)
                in_run = True
            if kind == "alloc":
                new(*args)
            elif kind == "reuse" and args[0] in held:
                old, new_name, delete_old = args
                hold(new_name, held[old])
                if delete_old:
                    drop(old)
            elif kind == "alias" and args[0] in held:
                hold(args[1], held[args[0]])
            elif kind == "release":
                drop(args[0])
            continue
        in_run = False
        background[-1] = max(background[-1], live)   # the state kernels of this step start in
        if kind == "free":
            drop(args[0])
        elif kind == "extern":
            volatile[-1] = True
            name, parts = args
            for element, nbytes in parts:
                sid = new(name, nbytes)
                if element is not None:
                    pending[element] = sid
        elif kind == "element" and args[0] in pending:
            hold(args[0], [pending.pop(args[0])])
        background[-1] = max(background[-1], live)
    background[-1] = max(background[-1], live)
    return background, volatile


def backgrounds(inputs: Sequence[tuple[str, int]], events: Sequence[tuple]
                ) -> tuple[list[list[int]], list[bool]]:
    """The background scenarios (the caller frees the inputs the graph frees, or keeps them;
    one when both agree) and the volatile steps."""
    scenarios: list[list[int]] = []
    for caller_keeps_inputs in (False, True):
        background, volatile = background_bytes(inputs, events, caller_keeps_inputs)
        if background not in scenarios:
            scenarios.append(background)
    return scenarios, volatile
