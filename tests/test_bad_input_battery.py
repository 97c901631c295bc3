"""The bad-input battery (``tests/battery/cases.py``): every case in its own process (forked
from a server that imported torch once) under a time bound. A case that must fail raises the
declared exception (Dynamo's wrapper of a backend error is looked inside), whose message names
what the case lists and a fix; a case that must work computes what one device computes. No
case may hang, crash inside the compiler, or compute a wrong number."""

import multiprocessing
import traceback

import pytest

from tests.battery.cases import CASES

TIME_LIMIT_S = 120


def _run(name: str, conn) -> None:
    from tests.battery.cases import CASES

    try:
        CASES[name].fn()
        conn.send(("ok", [], ""))
    except BaseException as exc:  # report everything: the parent judges
        chain, seen = [], exc
        while seen is not None and len(chain) < 6:
            chain.append((type(seen).__name__, [c.__name__ for c in type(seen).__mro__],
                          str(seen)))
            seen = getattr(seen, "inner_exception", None) or seen.__cause__ or seen.__context__
        conn.send(("raised", chain, "".join(traceback.format_exception(exc))[-3000:]))


@pytest.fixture(scope="module")
def ctx():
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["tests.battery.cases"])
    return context


def test_battery_has_at_least_sixty_cases():
    assert len(CASES) >= 60, len(CASES)


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input(ctx, name):
    case = CASES[name]
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_run, args=(name, send))
    proc.start()
    send.close()
    got = recv.recv() if recv.poll(TIME_LIMIT_S) else None
    proc.join(10)
    if proc.is_alive():
        proc.kill()
    assert got is not None, f"{name}: no answer in {TIME_LIMIT_S} s (a hang), exit {proc.exitcode}"
    status, chain, tb = got
    if case.raises is None:
        assert status == "ok", f"{name} must work; it raised:\n{tb}"
        return
    assert status == "raised", f"{name} must raise {case.raises.__name__}; it ran through"
    want = case.raises.__name__
    match = next(((kind, msg) for kind, mro, msg in chain if want in mro), None)
    assert match is not None, f"{name}: want {want}, got {[c[0] for c in chain]}:\n{tb}"
    msg = match[1]
    missing = [m for m in case.mentions if m not in msg]
    assert not missing, f"{name}: the message does not name {missing}:\n{msg}"
    if case.fix:
        assert "fix" in msg.lower(), f"{name}: the message names no fix:\n{msg}"
