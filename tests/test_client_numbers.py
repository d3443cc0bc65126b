"""The numbers every client of this repository shares (shmrl/config/faces.py:
``REPLY_TIMEOUT_S``, ``GIVE_UP_S``, ``EXIT_GRACE_S``) read the same in the code of each
client (shmrl.sim, the JavaScript client, the C header, the C# client, the Godot addon), in
the conformance checker, and in docs/RLLINK.md and docs/CLIENTS.md: an edit of one without the
others fails here."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from shmrl.config.faces import EXIT_GRACE_S, GIVE_UP_S, REPLY_TIMEOUT_S, SimSettings

ROOT = Path(__file__).resolve().parents[1]
C_HEADER = ROOT / "clients" / "c" / "shmrl_client.h"
JS_CLIENT = ROOT / "clients" / "js" / "shmrl_client.js"
JS_CARTPOLE = ROOT / "clients" / "js" / "cartpole.js"
CS_CLIENT = ROOT / "clients" / "csharp" / "ShmrlClient.cs"
GODOT_CLIENT = ROOT / "clients" / "godot" / "addons" / "shmrl" / "shmrl_client.gd"


def text(path: Path) -> str:
    """The file with its whitespace runs made one space (a sentence may wrap anywhere)."""
    return " ".join(path.read_text().split())


def c_define(name: str) -> float:
    found = re.findall(rf"^#define {name} ([0-9.]+)\b", C_HEADER.read_text(), re.M)
    assert len(found) == 1, f"{C_HEADER.name}: #define {name} found {len(found)} times"
    return float(found[0])


def js_const(name: str) -> float:
    found = re.findall(rf"^const {name} = ([0-9.]+);", JS_CLIENT.read_text(), re.M)
    assert len(found) == 1, f"{JS_CLIENT.name}: const {name} found {len(found)} times"
    return float(found[0])


def cs_const(name: str) -> float:
    found = re.findall(rf"public const double {name} = ([0-9.]+);", CS_CLIENT.read_text())
    assert len(found) == 1, f"{CS_CLIENT.name}: const double {name} found {len(found)} times"
    return float(found[0])


def cs_longest_backoff_s() -> float:
    found = re.findall(r"BackoffMaxS = ([0-9.]+);", CS_CLIENT.read_text())
    assert len(found) == 1
    return float(found[0])


def gd_const(name: str) -> float:
    found = re.findall(rf"^const {name} = ([0-9.]+)\b", GODOT_CLIENT.read_text(), re.M)
    assert len(found) == 1, f"{GODOT_CLIENT.name}: const {name} found {len(found)} times"
    return float(found[0])


def c_give_up_s() -> float:
    """The longest the C header's shmrl_reconnect waits in all before it gives up, with its
    default retries: min(backoff_s * 2^(i-1), backoff_max_s) before retry i."""
    base, top, retries = c_define("SHMRL_BACKOFF_S"), c_define("SHMRL_BACKOFF_MAX_S"), c_define("SHMRL_MAX_RETRIES")
    return round(sum(min(base * 2 ** (i - 1), top) for i in range(1, int(retries) + 1)), 6)


def js_longest_backoff_s() -> float:
    found = re.findall(r"backoffMs = Math\.min\(backoffMs \* 2, (\d+)\)", JS_CLIENT.read_text())
    assert len(found) == 1
    return int(found[0]) / 1000


def test_the_clients_code_uses_the_one_reply_timeout_and_give_up_time():
    assert SimSettings().timeout == REPLY_TIMEOUT_S
    assert c_define("SHMRL_REPLY_TIMEOUT_S") == REPLY_TIMEOUT_S
    assert "opt->reply_timeout_s = SHMRL_REPLY_TIMEOUT_S;" in C_HEADER.read_text()
    assert js_const("REPLY_TIMEOUT_S") == REPLY_TIMEOUT_S
    assert js_const("GIVE_UP_S") == GIVE_UP_S
    assert "timeoutS: REPLY_TIMEOUT_S, giveUpS: GIVE_UP_S" in JS_CLIENT.read_text()        # runClient
    assert "timeout: REPLY_TIMEOUT_S, giveUp: GIVE_UP_S" in JS_CARTPOLE.read_text()         # its flags
    assert c_give_up_s() <= GIVE_UP_S
    assert cs_const("REPLY_TIMEOUT_S") == REPLY_TIMEOUT_S
    assert cs_const("GIVE_UP_S") == GIVE_UP_S
    assert "ReplyTimeoutS = ShmrlClient.REPLY_TIMEOUT_S;" in CS_CLIENT.read_text()          # ShmrlOptions
    assert "GiveUpS = ShmrlClient.GIVE_UP_S;" in CS_CLIENT.read_text()
    assert gd_const("REPLY_TIMEOUT_S") == REPLY_TIMEOUT_S
    assert gd_const("GIVE_UP_S") == GIVE_UP_S
    gd = GODOT_CLIENT.read_text()
    # the Godot node's reads wait REPLY_TIMEOUT_S, its retries end GIVE_UP_S after the server went away
    assert gd.count('_request(ping, "PONG", REPLY_TIMEOUT_S)') == 1 and gd.count('"ACTIONS", REPLY_TIMEOUT_S)') == 1
    assert "OS.get_ticks_msec() - _lost_at_ms > GIVE_UP_S * 1000" in gd


def godot_longest_backoff_s() -> float:
    found = re.findall(r"backoff = min\(backoff \* 2, ([0-9.]+)\)", GODOT_CLIENT.read_text())
    assert len(found) == 1
    return float(found[0])


def test_the_checker_waits_for_a_client_to_give_up():
    """Once the checker stops listening, a client that keeps trying for GIVE_UP_S (and then
    sleeps out its longest backoff) still ends within the checker's grace."""
    from shmrl.checker import session

    assert session.EXIT_GRACE_S == EXIT_GRACE_S
    assert EXIT_GRACE_S >= GIVE_UP_S + js_longest_backoff_s() + 0.5
    assert EXIT_GRACE_S >= GIVE_UP_S + cs_longest_backoff_s() + 0.5
    assert EXIT_GRACE_S >= GIVE_UP_S + godot_longest_backoff_s() + 0.5


# (file, a pattern whose group is the number, the number it must be)
STATED = [
    ("docs/RLLINK.md", r"shmrl's clients wait (\d+) s", REPLY_TIMEOUT_S),
    ("docs/CLIENTS.md", r"Every client of this repository waits (\d+) s for a reply", REPLY_TIMEOUT_S),
    ("docs/CLIENTS.md", r"`--timeout` \(seconds to wait for a reply, (\d+)\)", REPLY_TIMEOUT_S),
    ("docs/CLIENTS.md", r"`reply_timeout_s` \((\d+) s\) for each reply", REPLY_TIMEOUT_S),
    ("docs/CLIENTS.md", r"\| `--reply-timeout S` \| (\d+) \|", REPLY_TIMEOUT_S),
    ("docs/CLIENTS.md", r"the JavaScript client's `--give-up-s`, (\d+) s", GIVE_UP_S),
    ("docs/CLIENTS.md", r"stayed away for `--give-up-s`, (\d+) s", GIVE_UP_S),
    ("docs/CLIENTS.md", r"`--give-up-s` \((\d+)\)", GIVE_UP_S),
    ("docs/CLIENTS.md", r"the C client gives up after its retries, at most ([\d.]+) s of waits", c_give_up_s()),
    ("docs/CLIENTS.md", r"stayed away for `ShmrlOptions.GiveUpS`, (\d+) s", GIVE_UP_S),
    ("docs/CLIENTS.md", r"waited for up to `ShmrlOptions.ReplyTimeoutS`, (\d+) s", REPLY_TIMEOUT_S),
    ("docs/CLIENTS.md", r"The conformance checker gives a client (\d+) s to end", EXIT_GRACE_S),
    ("docs/CLIENTS.md", r"waits up to the reply timeout, `REPLY_TIMEOUT_S` \((\d+) s\)", REPLY_TIMEOUT_S),
    ("docs/CLIENTS.md", r"the addon's `GIVE_UP_S`, (\d+) s, after a session", GIVE_UP_S),
    ("docs/CLIENTS.md", r"the client has (\d+) s to end on its own", EXIT_GRACE_S),
]


@pytest.mark.parametrize("doc, pattern, value", STATED, ids=[f"{d}:{p[:40]}" for d, p, _ in STATED])
def test_the_docs_state_the_same_numbers(doc, pattern, value):
    found = re.findall(pattern, text(ROOT / doc))
    assert len(found) == 1, f"{doc}: {pattern!r} found {len(found)} times"
    assert float(found[0]) == value, f"{doc} says {found[0]} where the code has {value:g}"


def test_the_docs_state_the_servers_hang_timeout():
    from shmrl.config.settings import Config

    hang = Config().hang_timeout
    assert re.findall(r"falls silent for `--hang-timeout` \((\d+) s\)", text(ROOT / "docs" / "CLIENTS.md")) == \
        [f"{hang:g}"]
    assert re.findall(r"`--hang-timeout` seconds \(default (\d+);", text(ROOT / "docs" / "RLLINK.md")) == \
        [f"{hang:g}"]
