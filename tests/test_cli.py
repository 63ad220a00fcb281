"""The ``loong`` command: tables, JSON, plots, and exit code 2 with a message on bad input."""

import json
import subprocess
import sys

import pytest

from loong_compile.cli import main


def run(capsys, *argv):
    """(exit code, stdout, stderr) of ``loong argv`` run in-process."""
    try:
        code = main(list(argv))
    except SystemExit as exc:          # argparse rejects syntax and values this way
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_estimate_prints_the_breakdown(capsys):
    code, out, _ = run(capsys, "estimate", "--model", "llama3.1-8b", "--seq", "8192", "--gpus", "8",
                       "--tp", "4", "--pp", "2", "--gpu", "a100-40gb")
    assert code == 0
    assert "optimizer states" in out and "27.20" in out and "fits" in out


def test_estimate_json_matches_the_paper_cell(capsys):
    code, out, _ = run(capsys, "estimate", "--model", "llama3.1-8b", "--seq", "8K", "--gpus", "16",
                       "--tp", "2", "--cp", "2", "--pp", "4", "--capacity-gib", "40", "--json",
                       "--unchunked-lm-head")
    data = json.loads(out)
    assert code == 0 and data["estimate_gib"] == pytest.approx(23.19, abs=0.01)   # Table 2
    assert data["config"]["dp"] == 1 and data["verdict"] == "fits"


def test_estimate_extension_switches(capsys):
    code, out, _ = run(capsys, "estimate", "--model", "7b-gqa", "--seq", "1M", "--gpus", "64", "--cp", "8",
                       "--hp", "8", "--inner-ring", "2", "--zero", "3", "--activations", "memo", "--alpha",
                       "0.25", "--exact", "--double-ring-buffers", "--cuda-context-gib", "0.5",
                       "--gpu", "a100", "--json")
    data = json.loads(out)
    assert code == 0
    assert {"activations: MEMO rounding buffers", "Double-Ring KV buffers"} <= set(data["terms_gib"])
    assert data["host_gib"]["host: offloaded activations"] > 0
    assert data["overheads_gib"]["CUDA context"] == 0.5


def test_plan_prints_a_ranked_table_and_options(capsys):
    code, out, _ = run(capsys, "plan", "--model", "llama3.1-8b", "--seq", "128K", "--gpus", "64", "--gpu", "h100")
    assert code == 0
    assert "attn ms/layer" in out and "headroom" in out
    assert 'backend="loong", options={' in out and "pruned:" in out


def test_plan_json(capsys):
    code, out, _ = run(capsys, "plan", "--model", "7b-gqa", "--seq", "256K", "--gpus", "32", "--gpu", "a100",
                       "--activations", "sc++,memo", "--alphas", "0.5", "--top", "3", "--json")
    data = json.loads(out)
    assert code == 0 and len(data["ranked"]) == 3
    first = data["ranked"][0]
    assert first["options"]["activations"] in ("sc++", "memo") and first["cost"]["attention"]["total_s"] > 0
    assert sum(data["pruned_reasons"].values()) == len(data["pruned"])


def test_plan_max_seq(capsys):
    """``--max-seq``: the longest length and the plan at it, in the table and in JSON."""
    argv = ("plan", "--model", "llama3.1-8b", "--gpus", "8", "--gpu", "h100", "--max-seq")
    code, out, _ = run(capsys, *argv, "--json")
    data = json.loads(out)
    assert code == 0 and data["max_seq"] == data["seq"] == max(m["longest"] for m in data["meshes"]) > 0
    assert data["ranked"] and f"--seq {data['max_seq']} " in data["ranked"][0]["launch"]
    code, out, _ = run(capsys, *argv, "--seq-multiple", "64K")
    assert code == 0 and "the longest sequence each mesh fits" in out and "longest sequence that fits:" in out
    assert 'backend="loong", options={' in out


def test_plan_with_user_defined_hardware(capsys, tmp_path):
    profile = tmp_path / "cluster.json"
    profile.write_text(json.dumps({"memory_gib": 64, "gpus_per_node": 4, "nics_per_node": 2, "nic_gbps": 25,
                                   "nvlink_gbps": 100, "hbm_gbps": 1600, "peak_tflops": 200}))
    code, out, _ = run(capsys, "plan", "--model", "7b-mha", "--seq", "64K", "--gpus", "16", "--gpu", str(profile),
                       "--gpu-opt", "nics_per_node=4", "--json")
    data = json.loads(out)
    assert code == 0 and data["hardware"]["nics_per_node"] == 4 and data["hardware"]["name"] == "cluster"


def test_plot_files(capsys, tmp_path):
    pytest.importorskip("matplotlib")
    est, pln = tmp_path / "memory.png", tmp_path / "plan.svg"
    assert run(capsys, "estimate", "--model", "llama2-7b", "--seq", "4096", "--gpus", "8", "--tp", "2",
               "--gpu", "a100", "--plot", str(est))[0] == 0
    assert run(capsys, "plan", "--model", "7b-gqa", "--seq", "128K", "--gpus", "16", "--gpu", "a100",
               "--plot", str(pln))[0] == 0
    assert est.read_bytes().startswith(b"\x89PNG") and b"<svg" in pln.read_bytes()[:400]


def test_hugging_face_config(capsys, tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model_type": "llama", "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
                                  "num_key_value_heads": 8, "intermediate_size": 8192, "vocab_size": 128256}))
    code, out, _ = run(capsys, "estimate", "--model", str(config), "--seq", "8192", "--gpus", "2",
                       "--capacity-gib", "80", "--json")
    assert code == 0 and json.loads(out)["model"]["kv_heads"] == 8


BAD_INPUTS = [
    (("estimate", "--model", "llama9", "--seq", "8192", "--gpu", "h100"), "unknown model 'llama9'"),
    (("plan", "--model", "llama3.1-8b", "--seq", "128K", "--gpus", "64", "--gpu", "tpu"), "unknown GPU 'tpu'"),
    (("estimate", "--model", "llama3.1-8b", "--seq", "8192", "--gpus", "63", "--cp", "8", "--gpu", "h100"),
     "--gpus 63"),
    (("estimate", "--model", "llama3.1-8b", "--seq", "1000", "--cp", "8", "--gpu", "h100"), "sequence length 1000"),
    (("estimate", "--model", "llama3.1-8b", "--seq", "8192", "--hp", "3", "--gpu", "h100"), "hp=3"),
    (("estimate", "--model", "llama3.1-8b", "--seq", "8192", "--gpus", "8"), "capacity missing"),
    (("estimate", "--model", "llama3.1-8b", "--seq", "0", "--gpu", "h100"), "'0' is not a positive integer"),
    (("estimate", "--model", "llama3.1-8b", "--seq", "8192", "--cp", "-2", "--gpu", "h100"),
     "'-2' is not a positive integer"),
    (("estimate", "--model", "llama3.1-8b", "--seq", "8192", "--gpus", "8", "--capacity-gib", "0"),
     "'0' is not a number > 0"),
    (("estimate", "--model", "llama3.1-8b", "--seq", "8192", "--alpha", "2", "--gpu", "h100"),
     "'2' is not a number >= 0 and <= 1"),
    (("plan", "--model", "llama3.1-8b", "--seq", "128K", "--gpus", "64"), "hardware missing"),
    (("plan", "--model", "llama3.1-8b", "--seq", "128K", "--gpus", "64", "--gpu", "h100",
      "--gpu-opt", "nics=4"), "unknown hardware field(s) nics"),
    (("plan", "--model", "llama3.1-8b", "--seq", "128K", "--gpus", "64", "--gpu", "h100",
      "--activations", "selective"), "'selective': choose from none, sc++, memo, full, full_offload"),
    (("plan", "--model", "llama3.1-8b", "--seq", "128K", "--gpus", "8", "--gpu", "h100", "--seq-multiple", "1K"),
     "--seq-multiple 1024 with --seq 131072"),
]


@pytest.mark.parametrize("argv,message", BAD_INPUTS, ids=[m for _, m in BAD_INPUTS])
def test_bad_input_exits_2_naming_the_value(capsys, argv, message):
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert message in err and out == ""


def test_profile_without_capacity(capsys, tmp_path):
    profile = tmp_path / "nocap.json"
    profile.write_text(json.dumps({"gpus_per_node": 8, "nics_per_node": 4, "nic_gbps": 25, "nvlink_gbps": 300,
                                   "hbm_gbps": 2000, "peak_tflops": 300}))
    code, _, err = run(capsys, "plan", "--model", "7b-gqa", "--seq", "128K", "--gpus", "8", "--gpu", str(profile))
    assert code == 2 and "missing capacity (memory_gib)" in err


def test_console_script_exit_code():
    """The installed entry point's module, as a process: status 2 and the message on stderr."""
    proc = subprocess.run([sys.executable, "-m", "loong_compile.cli", "plan", "--model", "nope", "--seq", "8K",
                           "--gpus", "8", "--gpu", "h100"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown model 'nope'" in proc.stderr


def test_estimator_and_cli_import_without_torch():
    """``loong plan`` runs on a laptop: no estimate module (alpha's LP included) imports torch."""
    code = ("import sys; sys.modules['torch'] = None\n"
            "import pkgutil, importlib, loong_compile.estimate as e, loong_compile.cli\n"
            "for m in pkgutil.iter_modules(e.__path__): importlib.import_module('loong_compile.estimate.' + m.name)\n"
            "from loong_compile.cli import main\n"
            "sys.exit(main(['plan', '--model', '7b-gqa', '--seq', '128K', '--gpus', '8', '--gpu', 'a100', '--json']))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_estimate_counts_the_lm_head_chunked_unless_asked(capsys):
    """Issue 22: the LM head term as the compiler keeps it (chunked, loss in the graph), its
    chunk and source in the output; --unchunked-lm-head gives eq. 14's logits."""
    args = ("estimate", "--model", "llama3.1-8b", "--seq", "1M", "--gpus", "8", "--hp", "8",
            "--zero", "3", "--gpu", "h100")
    code, out, _ = run(capsys, *args)
    assert code == 0 and "C = 256 tokens per chunk" in out and "estimate/lm_head.py" in out
    chunked = json.loads(run(capsys, *args, "--json")[1])
    unchunked = json.loads(run(capsys, *args, "--json", "--unchunked-lm-head")[1])
    assert chunked["lm_head_chunk_tokens"] == 256 and unchunked["lm_head_chunk_tokens"] is None
    head = "activations: LM head"
    assert unchunked["terms_gib"][head] == pytest.approx(64.62, abs=0.01)      # eq. 14
    assert chunked["terms_gib"][head] == pytest.approx(3.14, abs=0.01)
    assert "chunked" in chunked["sources"][head] and "eq. 14" in unchunked["sources"][head]
