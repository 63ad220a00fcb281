"""The package as a user installs it: the sdist and wheel built from a clean copy of the checkout,
the wheel installed without -e into a fresh venv that reuses this environment's torch, then used
there (import, the `loong` script, a compile with backend="loong").

The editable install of the checkout serves any folder, listed or not; only an installed wheel
shows a package the build left out.
"""

import os
import shutil
import site
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# the checkout's folders of importable code, under the names they install as
SOURCE_ROOTS = {"loong_compile": ROOT / "loong_compile", "loong_compile.passes": ROOT / "passes"}

# Runs in the venv: everything comes from its site-packages, and a one-process compile of
# attention, forward and backward, equals eager.  Lowered by aot_eager: every pass of the
# dynamo, joint and split stages runs; Inductor compiling its C++ kernels from a cold cache
# took 30 s to 75 s more on 2 loaded cores, past this test's budget of 90 s.
USE = textwrap.dedent("""
    import importlib.util, sysconfig
    import torch
    import loong_compile, loong_compile.hf, loong_compile.passes

    site_packages = sysconfig.get_path("purelib")
    for module in (loong_compile, loong_compile.hf, loong_compile.passes):
        assert module.__file__.startswith(site_packages), module.__file__
    assert importlib.util.find_spec("passes") is None, "a top-level `passes` was installed"

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.out = torch.nn.Linear(32, 96), torch.nn.Linear(32, 32)

        def forward(self, x):
            q, k, v = self.qkv(x).unflatten(-1, (3, 4, 8)).permute(2, 0, 3, 1, 4)
            y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.out(y.transpose(1, 2).flatten(2)).square().mean()

    torch.manual_seed(0)
    model, x = Attention(), torch.randn(2, 16, 32)
    results = []
    compiled = torch.compile(model, backend="loong", fullgraph=True, options={"lowering": "aot_eager"})
    for step in (model, compiled):
        model.zero_grad()
        loss = step(x)
        loss.backward()
        results.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(results[1], results[0])
    print("compiled:", loong_compile.__file__)
""")


def checkout_packages() -> set[str]:
    """Every folder of the checkout holding Python code, as the package name it installs as."""
    names = set()
    for name, root in SOURCE_ROOTS.items():
        for folder in {p.parent for p in root.rglob("*.py")}:
            names.add(".".join([name, *folder.relative_to(root).parts]))
    return names


def clean_copy(dest: Path) -> Path:
    """The files a clone with the current changes would hold (tracked and new, not ignored):
    no build outputs or egg-info of the checkout leak into the build."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, check=True, capture_output=True, text=True).stdout
    for rel in filter(None, listed.split("\0")):
        if (ROOT / rel).is_file():  # a tracked file deleted but not yet `git rm`ed is listed
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, dest / rel)
    return dest


def run(*argv, **kwargs) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{argv} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.mark.slow  # 26 s to 68 s measured on 2 cores at a load average of 11 to 34
def test_wheel_installs_and_runs(tmp_path):
    # the sdist, then the wheel built from it (what `python -m build` does: a file the sdist
    # leaves out is missing from the wheel too); the build backend is this environment's
    # setuptools (the test extra), so nothing is downloaded
    source = clean_copy(tmp_path / "checkout")
    dist = tmp_path / "dist"
    run(sys.executable, "-m", "build", "--no-isolation", "--outdir", str(dist), str(source))
    [wheel] = dist.glob("*.whl")
    files = zipfile.ZipFile(wheel).namelist()
    packaged = {str(Path(f).parent).replace("/", ".") for f in files if f.endswith(".py")}
    missing = sorted(checkout_packages() - packaged)
    assert not missing, f"the wheel leaves out {missing} (a folder without __init__.py?)"
    assert {f.split("/")[0] for f in files if ".dist-info/" not in f} == {"loong_compile"}

    # A bare venv; the installed dependencies are reached through a .pth naming this
    # environment's site-packages, which puts them on sys.path without running the .pth files
    # there (the editable install's finder among them), so the checkout stays invisible.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    venv = tmp_path / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", str(venv))
    python = venv / "bin" / "python"
    run(sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-index",
        "--no-deps", str(wheel), env=env)
    venv_site = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))").strip())
    outer = [p for p in [*site.getsitepackages(), site.getusersitepackages()] if Path(p).is_dir()]
    (venv_site / "outer-site-packages.pth").write_text("\n".join(outer) + "\n")

    # -I: neither the working directory nor PYTHON* variables reach sys.path
    assert "usage: loong plan" in run(venv / "bin" / "loong", "plan", "--help", cwd=tmp_path, env=env)
    out = run(python, "-I", "-c", USE, cwd=tmp_path, env=env)
    assert f"compiled: {venv_site}" in out
    shutil.rmtree(tmp_path)  # kept when the test fails
