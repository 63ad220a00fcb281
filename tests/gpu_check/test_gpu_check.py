"""gpu-check's CPU-runnable parts: the loopback Double-Ring against full-sequence SDPA
(float64), the JSON/markdown report, and every GPU check skipped with its reason."""

import json

import pytest
import torch

from loong_compile import gpu_check
from loong_compile.gpu_check.checks import CHECKS
from loong_compile.gpu_check.loopback import ring_attention, sdpa_reference
from loong_compile.gpu_check.report import CheckResult, Skip, markdown, run_check

pytestmark = pytest.mark.compat


@pytest.mark.parametrize("cp,inner_ring", [(4, 2), (4, 1), (2, 2)])
@pytest.mark.parametrize("is_causal", [True, False])
def test_loopback_double_ring_equals_full_sequence_sdpa(cp, inner_ring, is_causal):
    gen = torch.Generator().manual_seed(cp * 10 + inner_ring)
    q = torch.randn(1, 4, 32, 8, dtype=torch.float64, generator=gen)
    k, v = (torch.randn(1, 2, 32, 8, dtype=torch.float64, generator=gen) for _ in range(2))
    dout = torch.randn(q.shape, dtype=torch.float64, generator=gen)
    got = ring_attention(q, k, v, dout, cp=cp, inner_ring=inner_ring, is_causal=is_causal)
    want = sdpa_reference(q, k, v, dout, is_causal=is_causal)
    for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10, msg=name)


def test_loopback_ring_fails_when_a_block_is_dropped(monkeypatch):
    from loong_compile.ops.attention import ring

    def drop_last(cp_rank, cp, inner):  # a broken schedule must not pass the comparison
        return ring_schedule(cp_rank, cp, inner)[:-1]

    ring_schedule = ring.ring_schedule
    monkeypatch.setattr(ring, "ring_schedule", drop_last)
    q = torch.randn(1, 2, 16, 4, dtype=torch.float64)
    dout = torch.randn_like(q)
    got = ring_attention(q, q, q, dout, cp=2, inner_ring=2, is_causal=False)
    want = sdpa_reference(q, q, q, dout, is_causal=False)
    assert not torch.allclose(got[0], want[0])


def test_run_check_records_pass_skip_and_fail():
    def passing(figures):
        figures["x"] = 1
        return "fine"

    def skipping(figures):
        raise Skip("no CUDA device")

    def failing(figures):
        assert 1 + 1 == 3, "arithmetic is off"

    results = [run_check(n, f) for n, f in [("a", passing), ("b", skipping), ("c", failing)]]
    assert [(r.status, r.detail) for r in results[:2]] == [("pass", "fine"), ("skipped", "no CUDA device")]
    assert results[0].figures == {"x": 1}
    assert results[2].status == "fail" and "arithmetic is off" in results[2].detail


def test_markdown_has_one_row_per_check_and_the_environment():
    env = {"date": "2026-11-23", "gpu": "NVIDIA H100", "torch": "2.11.0", "cuda": "13.0",
           "flash_attn": None, "degraded_capabilities": ["inference_aware_post_grad_pass"]}
    text = markdown([CheckResult("kernels", "pass", "ok", {"e": 0.01}, 1.5),
                     CheckResult("memory_plan", "fail", "peak | grew", {}, 2.0)], env)
    assert "NVIDIA H100; torch 2.11.0; CUDA 13.0; flash-attn not installed" in text
    assert "| kernels | pass | 1.5 | ok |" in text and "| memory_plan | fail | 2.0 | peak / grew |" in text
    assert "inference_aware_post_grad_pass" in text and "1 pass, 1 fail, 0 skipped" in text


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the run without CUDA")
def test_without_cuda_every_check_is_skipped_with_the_reason_and_exit_is_zero(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [c["name"] for c in data["checks"]] == [name for name, _ in CHECKS]
    for check in data["checks"]:
        assert check["status"] == "skipped" and "no CUDA device" in check["detail"], check
    assert data["environment"]["torch"] == torch.__version__
    assert "| kernels | skipped |" in (tmp_path / "gpu_check.md").read_text()
    assert "no CUDA device" in capsys.readouterr().out


class _FakeEvent:
    """A CUDA event's timing interface: a timestamp in ms."""

    def __init__(self, ms):
        self.ms, self.synced = ms, False

    def synchronize(self):
        self.synced = True

    def elapsed_time(self, end):
        return end.ms - self.ms


def test_exposed_time_per_layer_sums_each_kinds_blocked_milliseconds():
    from loong_compile.ops.exposure import per_layer

    records = [(0, "offload", _FakeEvent(1.0), _FakeEvent(1.5)), (0, "offload", _FakeEvent(4.0), _FakeEvent(4.25)),
               (1, "reload", _FakeEvent(9.0), _FakeEvent(12.0)), (-1, "all_to_all", _FakeEvent(2.0), _FakeEvent(2.5))]
    assert per_layer(records) == {0: {"offload": 0.75, "offload_waits": 2},
                                  1: {"reload": 3.0, "reload_waits": 1},
                                  -1: {"all_to_all": 0.5, "all_to_all_waits": 1}}
    assert all(end.synced for *_, end in records)


def test_off_cuda_a_copy_blocks_nothing_and_a_collective_wait_is_timed_on_the_host():
    import time

    from loong_compile.ops.exposure import blocking, recording
    from loong_compile.ops.offload import OFFLOAD, WAIT

    x = torch.randn(4)
    with recording() as records:
        host = WAIT(OFFLOAD(x), x, None, 0)          # a CPU copy is synchronous: no wait recorded
        assert records == [] and torch.equal(host, x)
        with blocking("collective", 2, x.device):
            time.sleep(0.02)
    [(layer, kind, start, end)] = records
    assert (layer, kind) == (2, "collective") and start.elapsed_time(end) >= 20