"""The peak of the CPU allocator during a call, from the profiler's allocation events: what
tests and benchmarks compare a memory plan's predicted peak with."""

from __future__ import annotations


def measure_peak_bytes(fn):
    """``(fn(), peak)``: the most bytes the CPU allocator held during ``fn`` above what it
    held when ``fn`` started, from the profiler's allocation events (tests, benchmarks)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag.name == "Allocation":
            events.append(node)
    if not events:
        return result, 0
    events.sort(key=lambda n: n.start_time_ns)
    start = events[0].extra_fields.total_allocated - events[0].extra_fields.alloc_size
    return result, max(n.extra_fields.total_allocated for n in events) - start
