"""Settings declared once (specdec.core.settings): every service's flags and environment variables come from
its config dataclasses' fields, through the real parsers the entry points use. Booleans parse as booleans
from the environment (issue 33: SPECDEC_TARGET_FUSED_OPS=false turns fused ops off); every flag and
variable of before the mechanism still works; docs/settings.md is the generated table, never stale."""

from __future__ import annotations

import dataclasses
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.core.settings import FALSE, TRUE, Settings, comments, setting
from specdec.serving.flags import service_parser
from tests import settings_doc

ROOT = Path(__file__).resolve().parent.parent

# Every flag each entry point had before the settings were declared once (users' scripts and deploy/ use them).
TIER = ("address capture-sessions capture-tokens coalesce-ms device draft-chain dtype fused-ops grace idle-ttl "
        "kv-memory-gib log-format log-level max-batch-sessions max-batch-tokens max-cached-tokens max-connection-age "
        "max-connection-age-grace max-draft-tokens max-message-bytes max-queue max-session-tokens max-sessions "
        "metrics-address model port-file prefill-chunk prefix-block-tokens prefix-cache row-attention skinny-gemm "
        "step-mode threads tls-cert tls-client-ca tls-key").split()
OLD_FLAGS = {
    "target": TIER,
    "draft": TIER + ["draft-top-n"],
    "coordinator": (
        "address grace max-message-bytes max-connection-age max-connection-age-grace port-file log-level log-format "
        "metrics-address tls-cert tls-key tls-client-ca adaptive-max-k adaptive-min-gain admission-wait auth-token "
        "auth-token-file connect-timeout default-k default-max-new-tokens default-proposer draft draft-max-sessions "
        "draft-tree-branching draft-tree-nodes draft-tree-scheme http-address lookup-max-ngram lookup-min-ngram "
        "max-concurrency max-k max-new-tokens-cap max-prompt-tokens max-rps min-resolution-interval overlap "
        "prefix-route-tokens rpc-timeout served-model-name speculate-outcomes suffix-cache-entries suffix-cache-mb "
        "suffix-max-depth suffix-max-spec-factor suffix-max-spec-offset suffix-min-token-prob target tier-ca "
        "tier-client-cert tier-client-key tier-retry-timeout tier-server-name tokenizer tree-nodes").split(),
    "serve": ("device draft-dtype draft-model dtype host http-port metrics-port port served-model-name start-timeout "
              "target-model threads target-args draft-args coordinator-args").split(),
}


@functools.cache
def services() -> dict[str, Settings]:
    return {s.service: s for _, _, s in settings_doc.services()}


def parse(service: str, argv=(), environ=None) -> dict:
    s = services()[service]
    return s.parse(service_parser(s, "test"), list(argv), environ or {})


def get(configs: dict, dest: str):
    value = configs
    for name in dest.split("."):
        value = value[name] if isinstance(value, dict) else getattr(value, name)
    return value


def test_every_old_flag_and_variable_is_still_there():
    for service, flags in OLD_FLAGS.items():
        have = services()[service].by_flag
        assert not [f for f in flags if f not in have], service
        for flag in flags:
            assert have[flag].env == f"SPECDEC_{service.upper()}_{flag.replace('-', '_').upper()}"
    # the variables deploy/ and the docs name
    envs = {s.env for settings in services().values() for s in settings.settings}
    named = set()
    for path in [*ROOT.joinpath("deploy").rglob("*"), *ROOT.joinpath("docs").glob("*.md"), ROOT / "README.md"]:
        if path.is_file():
            named |= set(re.findall(r"SPECDEC_(?:TARGET|DRAFT|COORDINATOR|SERVE)_[A-Z_]*[A-Z]", path.read_text(errors="ignore")))
    assert named and not named - envs, sorted(named - envs)


@pytest.mark.parametrize("flag", ["fused-ops", "draft-chain", "skinny-gemm", "row-attention", "prefix-cache"])
@pytest.mark.parametrize("service", ["target", "draft"])
def test_tier_booleans_from_the_environment(service, flag):
    s = services()[service].by_flag[flag]
    assert parse(service)["config"] is not None and get(parse(service), s.dest) is True  # default on
    for text in FALSE + tuple(t.upper() for t in FALSE) + ("Off", " no "):
        assert get(parse(service, environ={s.env: text}), s.dest) is False, text
    for text in TRUE + ("TRUE", "Yes"):
        assert get(parse(service, environ={s.env: text}), s.dest) is True, text
    # the command line wins over the environment, both ways
    assert get(parse(service, [f"--{flag}"], {s.env: "false"}), s.dest) is True
    assert get(parse(service, [f"--no-{flag}"], {s.env: "true"}), s.dest) is False


def test_every_boolean_of_every_service_parses_from_the_environment():
    for service, settings in services().items():
        for s in settings.settings:
            if s.kind is bool:
                assert get(parse(service, environ={s.env: "false"}), s.dest) is False, s.env
                assert get(parse(service, environ={s.env: "on"}), s.dest) is True, s.env


def test_a_bad_value_in_the_environment_is_an_error_naming_the_variable(capsys):
    for env, text in (("SPECDEC_TARGET_FUSED_OPS", "maybe"), ("SPECDEC_TARGET_MAX_SESSIONS", "many"),
                      ("SPECDEC_TARGET_DTYPE", "float8"), ("SPECDEC_TARGET_CAPTURE_TOKENS", "1,x")):
        with pytest.raises(SystemExit) as e:
            parse("target", environ={env: text})
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert f"environment variable {env}" in err and repr(text) in err, err


@pytest.mark.processes
def test_a_bad_boolean_stops_a_real_tier_process_before_it_loads_a_model():
    run = subprocess.run([sys.executable, "-m", "target_service", "--model", "/nonexistent"], capture_output=True,
                         text=True, timeout=120, env={**__import__("os").environ, "SPECDEC_TARGET_FUSED_OPS": "nope"})
    assert run.returncode == 2
    assert "environment variable SPECDEC_TARGET_FUSED_OPS: expected a boolean" in run.stderr, run.stderr


def test_values_reach_the_configs():
    c = parse("target", ["--idle-ttl", "5", "--capture-tokens", "1,3", "--threads", "2", "--tls-cert", ""],
              {"SPECDEC_TARGET_MAX_SESSIONS": "7", "SPECDEC_TARGET_MODEL": "m", "SPECDEC_TARGET_MAX_QUEUE": "9"})
    tier = c["config"].tier
    assert (tier.sessions.idle_ttl_s, tier.sessions.max_sessions, tier.step.capture_tokens) == (5.0, 7, (1, 3))
    assert (tier.torch_threads, tier.model.path, tier.batch.max_queue, c["config"].server.tls_cert) == (2, "m", 9, None)
    assert c["config"].server.address == "127.0.0.1:50062" and c["config"].server.max_connection_age_s == 30.0
    assert parse("draft", ["--draft-top-n", "8"])["config"].draft_top_n == 8
    c = parse("coordinator", ["--draft", "", "--default-k", "3", "--suffix-cache-mb", "1.5", "--default-proposer", "lookup",
                              "--max-rps", "2", "--admission-wait", "1"], {"SPECDEC_COORDINATOR_OVERLAP": "yes"})["config"]
    assert c.draft_address is None and c.default_num_speculative_tokens == 3 and c.suffix.cache_bytes == int(1.5 * 2**20)
    assert c.default_proposer == "prompt_lookup" and c.overlap is True and c.server.address == "127.0.0.1:50051"
    assert (c.admission.max_requests_per_s, c.admission.max_queue_wait_s) == (2.0, 1.0)
    assert parse("coordinator", ["--default-k", "auto"])["config"].default_num_speculative_tokens is None
    s = parse("serve", ["--draft-model", "", "--metrics-port", "9"], {"SPECDEC_SERVE_HTTP_PORT": "8001"})["serve"]
    assert (s.draft_model, s.metrics_port, s.http_port, s.start_timeout_s) == (None, 9, 8001, 600.0)


def test_a_config_check_names_the_flags(capsys):
    for argv, message in ((["--tls-cert", "c.pem"], "--tls-cert and --tls-key must be given together"),
                          (["--max-connection-age", "-1"], "--max-connection-age and --max-connection-age-grace")):
        with pytest.raises(SystemExit):
            parse("target", argv)
        assert message in capsys.readouterr().err


def test_the_settings_table_is_current():
    assert settings_doc.PATH.read_text() == settings_doc.render(), "docs/settings.md is stale: run make settings-doc"


# The mechanism on made-up configs.

@dataclasses.dataclass(frozen=True)
class Inner:
    """The inner group. More words."""

    # Above the field,
    # two lines.
    wait_s: float = 1.5
    sizes: tuple[int, ...] = (1, 2)  # beside the field
    #                                  and continued

    #: Named things
    name: str | None = None  # may be none


@dataclasses.dataclass(frozen=True)
class Outer:
    flag_on: bool = True  # a switch
    renamed_field: int = setting(3, flag="short", aliases=("older",))  # renamed
    secret: str | None = setting(None, secret=True)  # a secret
    internal: int = setting(0, cli=False)  # not a setting
    inner: Inner = setting(Inner(), prefix="in-")


def test_fields_become_flags_with_their_comments_as_help():
    assert comments(Inner) == ({"wait_s": "Above the field, two lines.", "sizes": "beside the field and continued",
                                "name": "may be none"}, {"name": "Named things"})
    s = Settings("demo", {"root": Outer})
    assert [(x.flag, x.env, x.group) for x in s.settings] == [
        ("flag-on", "SPECDEC_DEMO_FLAG_ON", "Outer"), ("short", "SPECDEC_DEMO_SHORT", "Outer"),
        ("secret", "SPECDEC_DEMO_SECRET", "Outer"), ("in-wait", "SPECDEC_DEMO_IN_WAIT", "The inner group"),
        ("in-sizes", "SPECDEC_DEMO_IN_SIZES", "The inner group"), ("in-name", "SPECDEC_DEMO_IN_NAME", "Named things")]
    parser = __import__("argparse").ArgumentParser()
    s.add_to(parser)
    root = s.parse(parser, ["--older", "4", "--no-flag-on", "--in-sizes", "5,6", "--in-name", ""],
                   {"SPECDEC_DEMO_IN_WAIT": "2", "SPECDEC_DEMO_SECRET": "x"})["root"]
    assert root == Outer(flag_on=False, renamed_field=4, secret="x", inner=Inner(wait_s=2.0, sizes=(5, 6), name=None))
    assert s.parse(parser, [], {"SPECDEC_DEMO_OLDER": "8"})["root"].renamed_field == 8
    assert "| `--secret` | `SPECDEC_DEMO_SECRET` | unset | a secret |" in s.table()
    assert "| `--flag-on` / `--no-flag-on` | `SPECDEC_DEMO_FLAG_ON` | on | a switch |" in s.table()
    with pytest.raises(ValueError, match="declared twice"):
        Settings("demo", {"a": Outer, "b": Outer})
