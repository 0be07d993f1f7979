"""tokenyard/knobs.py: every TOKENYARD_* variable the engines, kernels and router runtime read parses
as documented, is read at call time, and is read there alone."""
from __future__ import annotations

import io
import logging
import re
import tokenize
from pathlib import Path

import pytest

from tokenyard import knobs

ROOT = Path(__file__).resolve().parents[2] / "tokenyard"


def test_quant_backend(monkeypatch):
    monkeypatch.delenv("TOKENYARD_QUANT_BACKEND", raising=False)
    assert knobs.quant_backend() == "auto"
    for raw, want in [("cpu", "cpu"), (" Triton ", "triton"), ("TORCH", "torch"), ("", "auto"), ("auto", "auto")]:
        monkeypatch.setenv("TOKENYARD_QUANT_BACKEND", raw)
        assert knobs.quant_backend() == want
    monkeypatch.setenv("TOKENYARD_QUANT_BACKEND", "cuda")
    with pytest.raises(ValueError, match="TOKENYARD_QUANT_BACKEND must be one of auto, cpu, triton, torch"):
        knobs.quant_backend()


@pytest.mark.parametrize(("name", "knob"), [("TOKENYARD_CPU_DECODE_STEP", knobs.cpu_decode_step),
                                            ("TOKENYARD_CPU_COMPILE", knobs.cpu_compile),
                                            ("TOKENYARD_CPU_ONEDNN_LINEAR", knobs.cpu_onednn_linear)])
def test_auto_on_off_modes(monkeypatch, caplog, name, knob):
    monkeypatch.delenv(name, raising=False)
    assert knob() == "auto"
    for raw, want in [("on", "on"), (" OFF ", "off"), ("Auto", "auto")]:
        monkeypatch.setenv(name, raw)
        assert knob() == want
    monkeypatch.setenv(name, "yes")
    with caplog.at_level(logging.WARNING, logger="tokenyard.knobs"):
        assert knob() == "auto"         # ignored: the config's own mode stands
    assert f"ignoring {name}='yes'" in caplog.text


def test_runner_override_replaces_only_auto(monkeypatch):
    from tokenyard.engines.model.model_runner import _env_override
    monkeypatch.setenv("TOKENYARD_CPU_COMPILE", "on")
    assert _env_override("auto", knobs.cpu_compile) == "on"
    assert _env_override("off", knobs.cpu_compile) == "off"    # an explicit config mode wins
    monkeypatch.setenv("TOKENYARD_CPU_COMPILE", "bogus")
    assert _env_override("auto", knobs.cpu_compile) == "auto"


def test_cpu_attention(monkeypatch):
    monkeypatch.delenv("TOKENYARD_CPU_ATTENTION", raising=False)
    assert knobs.cpu_attention_native()
    monkeypatch.setenv("TOKENYARD_CPU_ATTENTION", " Torch ")
    assert not knobs.cpu_attention_native()
    monkeypatch.setenv("TOKENYARD_CPU_ATTENTION", "whatever")
    assert knobs.cpu_attention_native()


def test_cpu_lora(monkeypatch):
    monkeypatch.delenv("TOKENYARD_CPU_LORA", raising=False)
    assert knobs.cpu_lora_native()
    monkeypatch.setenv("TOKENYARD_CPU_LORA", " Torch ")
    assert not knobs.cpu_lora_native()
    monkeypatch.setenv("TOKENYARD_CPU_LORA", "native")
    assert knobs.cpu_lora_native()


def test_native_march(monkeypatch):
    monkeypatch.delenv("TOKENYARD_NATIVE_MARCH", raising=False)
    assert knobs.native_march() == "native"
    monkeypatch.setenv("TOKENYARD_NATIVE_MARCH", "  ")
    assert knobs.native_march() == "native"
    monkeypatch.setenv("TOKENYARD_NATIVE_MARCH", " x86-64-v3 ")
    assert knobs.native_march() == "x86-64-v3"              # case kept: gcc's names are case-sensitive


def test_step_spin(monkeypatch):
    monkeypatch.delenv("TOKENYARD_STEP_SPIN", raising=False)
    assert knobs.step_spin() == knobs.DEFAULT_STEP_SPIN == 200_000
    monkeypatch.setenv("TOKENYARD_STEP_SPIN", "")
    assert knobs.step_spin() == 200_000
    monkeypatch.setenv("TOKENYARD_STEP_SPIN", " 2000 ")
    assert knobs.step_spin() == 2000
    for bad, message in [("1.5", "whole number"), ("many", "whole number"), ("0", "at least 1"), ("-3", "at least 1")]:
        monkeypatch.setenv("TOKENYARD_STEP_SPIN", bad)
        with pytest.raises(ValueError, match=message):
            knobs.step_spin()


def test_huge_pages(monkeypatch):
    monkeypatch.delenv("TOKENYARD_HUGE_PAGES", raising=False)
    assert knobs.huge_pages()
    for raw in ("off", "0", " FALSE "):
        monkeypatch.setenv("TOKENYARD_HUGE_PAGES", raw)
        assert not knobs.huge_pages()
    monkeypatch.setenv("TOKENYARD_HUGE_PAGES", "no")      # not one of the three: pages stay huge, as before
    assert knobs.huge_pages()


def test_weight_cache(monkeypatch, tmp_path):
    monkeypatch.delenv("TOKENYARD_WEIGHT_CACHE", raising=False)
    assert knobs.weight_cache()
    for raw in ("off", "0", " False ", "NO"):
        monkeypatch.setenv("TOKENYARD_WEIGHT_CACHE", raw)
        assert not knobs.weight_cache()
    monkeypatch.setenv("TOKENYARD_WEIGHT_CACHE", "on")
    assert knobs.weight_cache()
    monkeypatch.delenv("TOKENYARD_WEIGHT_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert knobs.weight_cache_dir() == str(tmp_path / "tokenyard" / "weights")
    monkeypatch.setenv("TOKENYARD_WEIGHT_CACHE_DIR", " /srv/cache ")
    assert knobs.weight_cache_dir() == "/srv/cache"


def test_router_native(monkeypatch):
    monkeypatch.delenv("TOKENYARD_ROUTER_NATIVE", raising=False)
    assert knobs.router_native()
    for raw in ("0", "off", " False ", "NO"):
        monkeypatch.setenv("TOKENYARD_ROUTER_NATIVE", raw)
        assert not knobs.router_native()
    monkeypatch.setenv("TOKENYARD_ROUTER_NATIVE", "on")
    assert knobs.router_native()


def test_only_knobs_reads_tokenyard_variables():
    """No module under engines, kernels or router_models reads a TOKENYARD_ variable from the
    environment itself: tokenyard/knobs.py is the one list of them. Caught both as a direct read
    (os.environ[...] / .get / os.getenv with the name) and as a variable's name standing alone as a
    string literal (handed to a helper that reads it, as model_runner's _env_override once was)."""
    reads = re.compile(r"""(os\.environ(\.get)?|os\.getenv)\s*[\[(]\s*["']TOKENYARD_""")
    offenders = []
    for package in ("engines", "kernels", "router_models"):
        for path in sorted((ROOT / package).rglob("*.py")):
            source = path.read_text()
            where = path.relative_to(ROOT.parent)
            for number, line in enumerate(source.splitlines(), 1):
                if reads.search(line):
                    offenders.append(f"{where}:{number}: {line.strip()}")
            for token in tokenize.generate_tokens(io.StringIO(source).readline):
                if token.type == tokenize.STRING and re.fullmatch(r"[rbuRBU]?(['\"])TOKENYARD_[A-Z0-9_]+\1", token.string):
                    offenders.append(f"{where}:{token.start[0]}: the name {token.string}")
    assert not offenders, "read these through tokenyard/knobs.py:\n" + "\n".join(offenders)


def test_every_variable_is_documented():
    """Each knob's variable is named in the module's docstring list (the docs point there)."""
    source = (ROOT / "knobs.py").read_text()
    named = set(re.findall(r'"(TOKENYARD_[A-Z_]+)"', source))
    assert len(named) == 13
    assert all(name in knobs.__doc__ for name in named)
