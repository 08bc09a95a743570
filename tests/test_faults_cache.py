"""Fault injection: the verdict cache, forged, copied, corrupted, opened to others, or
holding special files. Nothing forged is believed; a backend whose verdict cannot be
trusted fails closed until it is verified again; nothing hangs or grows without bound."""
from __future__ import annotations

import json
import logging
import os
import stat

import pytest

import capdispatch as cd
from capdispatch import extend
from capdispatch import proof
from capdispatch.proof import cache as C

from faults_util import bounded


@pytest.fixture
def env(tmp_path, monkeypatch):
    for k in ("CAPDISPATCH_POLICY", "CAPDISPATCH_SET", "CAPDISPATCH_STRICT", "CAPDISPATCH_LOCK",
              "TRITON_INTERPRET", "CAPDISPATCH_VERIFY"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("CAPDISPATCH_CACHE_DIR", str(tmp_path / "cache"))
    return dict(os.environ)


CPU = None


def cpu():
    global CPU
    CPU = CPU or cd.probe("cpu")
    return CPU


def verdict(backend="torch", outcome="pass", **kw):
    return proof.Verdict(op="kv_dequant", backend=backend, device="cpu", outcome=outcome, **kw)


def rewrite(path, **changes):
    body = json.loads(path.read_text())
    for k, v in changes.items():
        if k == "verdict":
            body["verdict"].update(v)
        else:
            body[k] = v
    path.write_text(json.dumps(body))


def decide(env):
    return cd.resolve("kv_dequant", "cpu", env=env)


def test_a_forged_pass_is_not_believed(env, caplog):
    path = proof.store(cpu(), "torch", verdict(outcome="runtime", detail="boom"), env=env)
    rewrite(path, verdict={"outcome": "pass", "detail": ""})          # the digest no longer matches
    with caplog.at_level(logging.WARNING, logger="capdispatch"):
        assert proof.lookup(cpu(), "kv_dequant", "torch", env=env) is None
        with pytest.raises(cd.NoBackendError, match="cannot be trusted"):
            decide(env)
    assert "keyed digest does not match" in caplog.text
    body = json.loads(path.read_text())
    del body["mac"]                                                    # no digest at all
    path.write_text(json.dumps(body))
    assert proof.lookup(cpu(), "kv_dequant", "torch", env=env) is None


def test_a_verdict_copied_under_another_name_is_refused(env, caplog):
    good = proof.store(cpu(), "torch", verdict(outcome="runtime", detail="real failure"), env=env)
    other = proof.store(cpu(), "triton_u8", verdict("triton_u8", "pass"), env=env)
    # a pass copied over another backend's failure: the file's key says where it belongs
    good.write_bytes(other.read_bytes())
    with caplog.at_level(logging.WARNING, logger="capdispatch"):
        assert proof.lookup(cpu(), "kv_dequant", "torch", env=env) is None
    assert "a copy or a forgery" in caplog.text
    # a second copy of a verdict under a made-up name is refused, and named
    stray = good.with_name("kv_dequant.torch.00000000000000000000.json")
    stray.write_bytes(other.read_bytes())
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="capdispatch"):
        proof.lookup(cpu(), "kv_dequant", "triton_u8", env=env)
    assert str(stray) in caplog.text


@pytest.mark.parametrize("mode", [0o664, 0o646])
def test_files_others_may_write_are_refused(env, mode):
    path = proof.store(cpu(), "torch", verdict(), env=env)
    os.chmod(path, mode)
    assert proof.lookup(cpu(), "kv_dequant", "torch", env=env) is None
    os.chmod(path, 0o600)
    assert proof.lookup(cpu(), "kv_dequant", "torch", env=env).passed
    os.chmod(path.parent, 0o777)                                       # the card's folder
    assert proof.lookup(cpu(), "kv_dequant", "torch", env=env) is None


@pytest.mark.skipif(not hasattr(os, "geteuid") or os.geteuid() != 0, reason="chown needs root")
def test_files_of_another_user_are_refused(env):
    path = proof.store(cpu(), "torch", verdict(), env=env)
    os.chown(path, 12345, 12345)
    assert proof.lookup(cpu(), "kv_dequant", "torch", env=env) is None


def test_the_secret_must_be_private(env, caplog):
    proof.store(cpu(), "torch", verdict(), env=env)
    key = C.cache_dir(env) / "verify" / C.KEY_NAME
    assert stat.S_IMODE(os.stat(key).st_mode) == 0o600
    os.chmod(key, 0o644)
    with caplog.at_level(logging.WARNING, logger="capdispatch"):
        assert proof.lookup(cpu(), "kv_dequant", "torch", env=env) is None
    assert "not trusted" in caplog.text and "secret" in caplog.text
    os.chmod(key, 0o600)
    key.write_text("x" * 64)                                           # another secret: nothing verifies
    os.chmod(key, 0o600)
    assert proof.lookup(cpu(), "kv_dequant", "torch", env=env) is None


@pytest.mark.parametrize("kind", ["fifo", "zero", "dir", "nested", "huge", "types"])
def test_special_and_hostile_files_do_not_hang_or_crash(env, kind, caplog):
    path = proof.store(cpu(), "torch", verdict(), env=env)
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "zero":
        path.symlink_to("/dev/zero")
    elif kind == "dir":
        path.mkdir()
    elif kind == "nested":
        path.write_text("[" * 50000 + "]" * 50000)
    elif kind == "huge":
        path.write_text(" " * (1 << 20) + "{}")
    elif kind == "types":
        body = {"schema": C.SCHEMA, "card": proof.open_card(cpu(), env=env).card,
                "backend": {"op": "kv_dequant"}, "verdict": {"outcome": ["pass"]}, "mac": 7}
        path.write_text(json.dumps(body))
    os.chmod(path, 0o600) if kind in ("nested", "huge", "types") else None
    with caplog.at_level(logging.WARNING, logger="capdispatch"):
        r = bounded(lambda: decide(env), 10)
    assert r["seconds"] < 5
    assert isinstance(r.get("error"), cd.NoBackendError), r          # fails closed, by name
    assert "cannot be trusted" in str(r["error"]) and str(path) in caplog.text


def test_verdict_fields_are_type_checked():
    base = verdict().to_dict()
    for field, bad in (("outcome", ["pass"]), ("seed", "1"), ("seed", True), ("max_err", "big"),
                       ("seconds", {"run": "slow"}), ("detail", 3), ("op", None)):
        with pytest.raises(ValueError):
            proof.Verdict.from_dict({**base, field: bad})


def sign(path, env):
    """Sign PATH's body again with the cache's own secret: what a bug or a forger with
    the secret could leave, so only the verdict's own checks stand between it and a crash."""
    body = json.loads(path.read_text())
    body.pop("mac", None)
    body["mac"] = C._mac(C._secret(env, create=False), body)
    path.write_text(json.dumps(body))


@pytest.mark.parametrize("bad", [10**400, float("nan"), float("-inf")])
def test_a_signed_verdict_with_an_impossible_max_err_is_untrusted_not_a_crash(env, bad, caplog, capsys):
    path = proof.store(cpu(), "torch", verdict(outcome="mismatch", max_err=3.0, where="x"), env=env)
    rewrite(path, verdict={"max_err": bad})
    sign(path, env)
    with caplog.at_level(logging.WARNING, logger="capdispatch"):
        assert proof.lookup(cpu(), "kv_dequant", "torch", env=env) is None
        with pytest.raises(cd.NoBackendError, match="cannot be trusted"):    # fails closed
            decide(env)
    assert "max_err" in caplog.text and str(path) in caplog.text
    from capdispatch.dispatch import cli
    assert cli.main(["explain", "--device", "cpu", "--op", "kv_dequant"]) == 3
    assert "internal error" not in capsys.readouterr().err


def test_a_mismatch_of_non_finite_output_keeps_its_infinite_max_err(env):
    """A canary's check writes max_err Infinity for non-finite output: that verdict is the
    kernel's, and reads back trusted."""
    proof.store(cpu(), "torch", verdict(outcome="mismatch", max_err=float("inf"), where="x"), env=env)
    v = proof.lookup(cpu(), "kv_dequant", "torch", env=env)
    assert v is not None and v.max_err == float("inf") and "max error inf" in v.describe()


def test_a_suspect_backend_is_verified_again_and_then_trusted(env, monkeypatch):
    """verify_decisions does not take a suspect file as cached: the canary runs again."""
    from capdispatch.proof import runner
    monkeypatch.setattr(runner, "_BOOT", "import json, sys; cfg = json.loads(sys.argv.pop(1)); "
                        "sys.path[0:0] = cfg['path']; from capdispatch.proof.child import READY, _write; "
                        "print(READY, flush=True); _write(sys.argv[5], {'outcome': 'pass', 'seconds': {}})")
    path = proof.store(cpu(), "torch", verdict(outcome="runtime", detail="boom"), env=env)
    path.write_text("{ torn")
    os.chmod(path, 0o600)
    v = cd.verify_decisions(cpu(), {"kv_dequant": "torch"}, budget_s=30, env=env)
    assert [r.cached for r in v.results] == [False] and v.results[0].verdict.passed
    assert decide(env).backend == "torch"


def test_clear_cache_reports_what_happened(env, tmp_path, capsys):
    from capdispatch.dispatch import cli
    root, existed = proof.clear(env)
    assert not existed
    proof.store(cpu(), "torch", verdict(), env=env)
    root, existed = proof.clear(env)
    assert existed and not root.exists()
    root.parent.mkdir(parents=True, exist_ok=True)
    root.write_text("not a folder")
    with pytest.raises(C.CacheError, match="not a folder"):
        proof.clear(env)
    assert cli.main(["verify", "--clear-cache", "--device", "cpu", "--op", "kv_dequant"]) == 2
    err = capsys.readouterr().err
    assert "cleared" not in err and "not a folder" in err


def test_writes_are_private(env):
    path = proof.store(cpu(), "torch", verdict(), env=env)
    old = os.umask(0)
    try:
        path2 = proof.store(cpu(), "triton_u8", verdict("triton_u8"), env=env)
    finally:
        os.umask(old)
    for p in (path, path2):
        assert stat.S_IMODE(os.stat(p).st_mode) == 0o600
    for d in (path.parent, path.parent.parent, path.parent.parent.parent):
        assert stat.S_IMODE(os.stat(d).st_mode) & 0o022 == 0, d
    assert proof.lookup(cpu(), "kv_dequant", "triton_u8", env=env).passed


def test_escape_sequences_in_details_are_not_printed_raw(env):
    from capdispatch.dispatch.verify import Job, Result
    from capdispatch.dispatch.verify_cmd import render
    v = verdict(outcome="runtime", detail="\x1b]0;owned\x07\x1b[2J boom\nsecond \x1b[31mline")
    assert "\x1b" not in v.describe() and "\\x1b" in v.describe()
    text = render([Result(Job(cpu(), "kv_dequant", "torch"), v)])
    assert "\x1b" not in text and "\x07" not in text
    proof.store(cpu(), "torch", v, env=env)
    with pytest.raises(cd.NoBackendError) as err:
        decide(env)
    assert "\x1b" not in str(err.value)


def test_a_link_planted_at_a_verdicts_name_is_replaced_not_followed(env, tmp_path):
    path = proof.store(cpu(), "torch", verdict(), env=env)
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    path.unlink()
    path.symlink_to(victim)
    assert proof.lookup(cpu(), "kv_dequant", "torch", env=env) is None       # a link is not read
    assert proof.store(cpu(), "torch", verdict(), env=env) == path
    assert victim.read_text() == "precious\n" and not path.is_symlink()
    assert proof.lookup(cpu(), "kv_dequant", "torch", env=env).passed


def _spoil_key(key, how):
    if how == "mode0644":
        os.chmod(key, 0o644)
    elif how == "mode0640":
        os.chmod(key, 0o640)
    elif how == "symlink":
        target = key.with_name("elsewhere")
        target.write_bytes(key.read_bytes())
        os.chmod(target, 0o600)
        key.unlink()
        key.symlink_to(target)
    elif how == "truncated":
        key.write_text("abc")
    elif how == "empty":
        key.write_text("")
    elif how == "oversized":
        key.write_text("x" * 100000)
    elif how == "other_user":
        os.chown(key, 12345, 12345)


KEY_FAULTS = ["mode0644", "mode0640", "symlink", "truncated", "empty", "oversized"] + (
    ["other_user"] if hasattr(os, "geteuid") and os.geteuid() == 0 else [])


@pytest.mark.parametrize("how", KEY_FAULTS)
def test_an_untrusted_key_fails_closed_and_verify_still_records(env, how, caplog):
    """A known failure stays a failure whatever happens to the key file: the backend is
    suspect (rejected) rather than 'not verified' (chosen again under verify: warn), and the
    next verdict is recorded under a new secret."""
    proof.store(cpu(), "torch", verdict(outcome="runtime", detail="real failure"), env=env)
    key = C.cache_dir(env) / "verify" / C.KEY_NAME
    _spoil_key(key, how)
    with caplog.at_level(logging.WARNING, logger="capdispatch"):
        card = C.open_card(cpu(), env=env)
        assert card.get(extend.registry.builtin().backend("kv_dequant", "torch")) is None
        assert card.suspect(extend.registry.builtin().backend("kv_dequant", "torch"))
    assert "not trusted" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="capdispatch"):
        path = proof.store(cpu(), "torch", verdict(outcome="pass"), env=env)
    assert path is not None and "replacing it with a new secret" in caplog.text
    assert not key.is_symlink() and stat.S_IMODE(os.stat(key).st_mode) == 0o600
    assert proof.lookup(cpu(), "kv_dequant", "torch", env=env).passed
