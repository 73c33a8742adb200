"""`llumdask serve` options and startup errors; only the test marked slow starts a (failing) cluster."""

from __future__ import annotations

import socket
import time
from pathlib import Path
from dataclasses import replace

import pytest

from llumdask.api.gateway.tokenizer import served_tokenizer
from llumdask.api.serve import (banner, build_parser, dashed, engine_generation_args, engine_overrides,
                                gateway_engine_args, parse_engine_args, serve_main)


def test_defaults_are_two_instances_on_localhost_8000():
    args = build_parser().parse_args([])
    assert (args.instances, args.host, args.port, args.scheduler) == (2, "127.0.0.1", 8000, None)


def test_engine_options_pass_through_as_typed_values():
    assert parse_engine_args(dashed(["--total-blocks", "128", "--real-time", "--max_num_seqs=8", "--profile", "x"])) == {
        "total-blocks": 128, "real-time": True, "max-num-seqs": 8, "profile": "x"}
    with pytest.raises(ValueError, match="'stray'"):
        parse_engine_args(["stray"])


def test_options_spelt_with_underscores_are_serves_own_where_they_name_one():
    """As vLLM's command line: `--generation_config` is serve's option (it reached only the engines)."""
    args, rest = build_parser().parse_known_args(dashed(["--generation_config", "some_dir", "--max_num_seqs=8",
                                                         "--override-generation-config", '{"top_k": 2}']))
    assert args.generation_config == "some_dir" and args.override_generation_config == {"top_k": 2}
    assert rest == ["--max-num-seqs=8"]


def test_sim_instances_draw_tokens_the_tokenizer_can_decode():
    assert engine_overrides("sim", "/m", 512, {"total-blocks": 64}) == {
        "engine": "sim", "sim-engine": {"vocab-size": 512, "total-blocks": 64}}


def test_vllm_options_go_to_their_config_keys_or_through_as_engine_arguments():
    assert engine_overrides("vllm", None, 512, {"dtype": "half", "max-num-seqs": 8, "enforce-eager": False},
                            max_model_len=1024) == {
        "engine": "vllm",
        "vllm-engine": {"model": None, "dtype": "half", "enforce-eager": False, "max-model-len": 1024,
                        "engine-args": {"max_num_seqs": 8}}}


def test_bad_options_exit_2_naming_the_problem(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))  # the tiny model is built there
    assert serve_main(["--port", "0", "--engine", "sim", "--no-such-key", "1"]) == 2
    assert "llumdask.sim-engine.no-such-key is not a known key" in capsys.readouterr().err
    assert serve_main(["--port", "0", "--engine", "vllm", "--tensor-parallel-size", "0"]) == 2
    assert "llumdask.vllm-engine.tensor-parallel-size is invalid" in capsys.readouterr().err
    assert serve_main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err
    assert serve_main(["--engine", "sim", "--chat-template", str(tmp_path / "missing.jinja")]) == 2
    assert "chat template file" in capsys.readouterr().err
    # A generation config is read before any instance starts.
    assert serve_main(["--engine", "sim", "--generation-config", str(tmp_path / "missing")]) == 2
    assert "takes auto, vllm, a directory" in capsys.readouterr().err
    # Spelt with an underscore, as vLLM's command line takes it: still serve's own option.
    assert serve_main(["--engine", "sim", "--generation_config", str(tmp_path / "missing")]) == 2
    assert "takes auto, vllm, a directory" in capsys.readouterr().err
    assert serve_main(["--engine", "sim", "--override-generation-config", '{"top_k": 2.5}']) == 2
    assert "generation config: top_k must be an integer" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        serve_main(["--instances", "0"])
    assert exit_.value.code == 2


@pytest.mark.parametrize("option, value, words", [
    ("--port", "70000", "must be a TCP port"), ("--port", "-1", "must be a TCP port"),
    ("--port", "abc", "must be a TCP port"), ("--startup-timeout", "abc", "must be a number of seconds > 0"),
    ("--startup-timeout", "-1", "must be a number of seconds > 0"),
    ("--startup-timeout", "nan", "must be a number of seconds > 0"),
])
def test_options_are_checked_before_any_instance_starts(capsys, option, value, words):
    with pytest.raises(SystemExit) as exit_:
        serve_main(["--engine", "sim", option, value])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and f"argument {option}: {words}" in err


@pytest.mark.parametrize("text, words", [
    ("llumdask: [", "not YAML"), ("- 1\n- 2\n", "must be a mapping"), ("llumdask: 5\n", "must be a mapping"),
    ("llumdask: []\n", "must be a mapping"), ("llumdask: false\n", "must be a mapping"),
])
def test_a_config_file_that_is_not_a_config_is_named(capsys, tmp_path, text, words):
    (tmp_path / "bad.yaml").write_text(text)
    assert serve_main(["--engine", "sim", "--config", str(tmp_path / "bad.yaml")]) == 2
    err = capsys.readouterr().err
    assert f"--config {tmp_path / 'bad.yaml'}: {words}" in err and "Traceback" not in err


@pytest.mark.vllm
def test_parsers_are_checked_before_any_instance_starts(capsys, tmp_path, monkeypatch):
    """vLLM's parsers, by name and against the model's tokenizer, as `vllm serve` checks them; the
    sim engine has no syntax to read."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert serve_main(["--engine", "sim", "--reasoning-parser", "no_such_parser"]) == 2
    assert "vLLM has no reasoning parser 'no_such_parser'; it has: " in capsys.readouterr().err
    assert serve_main(["--engine", "sim", "--tool-call-parser", "no_such_parser"]) == 2
    assert "vLLM has no tool-call parser 'no_such_parser'" in capsys.readouterr().err
    # DeepSeek-R1's parser needs <think> and </think> tokens, which the tiny model has not.
    assert serve_main(["--engine", "sim", "--reasoning-parser", "deepseek_r1"]) == 2
    assert "--reasoning-parser deepseek_r1 cannot be used with the tokenizer" in capsys.readouterr().err
    assert serve_main(["--engine", "sim", "--reasoning-parser", "qwen3"]) == 2
    assert "--reasoning-parser qwen3: the vllm engine is needed" in capsys.readouterr().err


def test_a_generation_config_directory_reaches_the_vllm_engines_too(tmp_path):
    """vLLM's engine ends requests on the end tokens of the generation config it reads: the same as the gateway's."""
    assert engine_generation_args(str(tmp_path)) == {"generation-config": str(tmp_path.resolve())}
    assert engine_generation_args("Qwen/Qwen3-0.6B") == {"generation-config": "Qwen/Qwen3-0.6B"}  # a hub name
    assert engine_generation_args("auto") == engine_generation_args("vllm") == engine_generation_args(None) == {}
    assert engine_overrides("vllm", None, 512, engine_generation_args(str(tmp_path)))["vllm-engine"]["engine-args"] == {
        "generation_config": str(tmp_path.resolve())}


def test_the_gateway_s_own_options_reach_the_vllm_engines_too(tmp_path):
    """The tokenizer, generation config and reasoning parser, as `vllm serve` gives its engine them
    (its engine applies a structured output's grammar once the thinking it reads has ended)."""
    assert gateway_engine_args(None, None, None) == {}
    given = gateway_engine_args("/t", str(tmp_path), "qwen3")
    assert engine_overrides("vllm", None, 512, given)["vllm-engine"]["engine-args"] == {
        "tokenizer": "/t", "generation_config": str(tmp_path.resolve()), "reasoning_parser": "qwen3"}


@pytest.mark.vllm
def test_serve_starts_its_vllm_instances_with_the_gateway_s_options(capsys, tmp_path, monkeypatch):
    """What `llumdask serve` hands the local cluster (stopped there): the tokenizer and reasoning
    parser it reads answers with. vLLM's own check of the arguments (a process importing vLLM)
    answers at once: the tests that start instances run it."""
    import contextlib

    from modelcopies import with_thinking_tokens

    import llumdask.clusters.local
    from llumdask.api import serve
    from llumdask.clusters.instances import InstanceStartupError
    from llumdask.tiny_model import build_tiny_model, default_model_dir

    @contextlib.contextmanager
    def checked(config):
        yield lambda: serve.VllmCheck(device="cpu", free_bytes=8 << 30, total_bytes=16 << 30)

    monkeypatch.setattr(serve, "vllm_check", checked)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    tokenizer = with_thinking_tokens(build_tiny_model(default_model_dir()), tmp_path / "tokenizer")
    started: list[dict] = []

    def local_cluster(instances, engine, overrides, **kwargs):
        started.append(overrides)
        raise InstanceStartupError("stopped by the test")

    monkeypatch.setattr(llumdask.clusters.local, "local_cluster", local_cluster)
    assert serve_main(["--port", "0", "--engine", "vllm", "--tokenizer", str(tokenizer),
                       "--reasoning-parser", "qwen3"]) == 1
    assert "stopped by the test" in capsys.readouterr().err
    engine_args = started[-1]["vllm-engine"]["engine-args"]
    assert engine_args["tokenizer"] == str(tokenizer) and engine_args["reasoning_parser"] == "qwen3"


def test_banner_shows_urls_and_a_working_curl():
    text = banner("m", "2 sim instances", "http://127.0.0.1:8000", "tcp://127.0.0.1:1", "http://127.0.0.1:8787/status",
                  needs_key=True)
    assert "http://127.0.0.1:8000/v1" in text and "http://127.0.0.1:8787/status" in text
    assert "curl http://127.0.0.1:8000/v1/chat/completions" in text
    assert 'Authorization: Bearer $LLUMDASK_API_KEY' in text and '"model": "m"' in text


@pytest.mark.vllm
def test_misspelt_vllm_engine_argument_fails_before_any_instance_starts(capsys, tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert serve_main(["--port", "0", "--engine", "vllm", "--max-num-seq", "8"]) == 2
    err = capsys.readouterr().err
    assert "llumdask.vllm-engine.engine-args.max_num_seq is not a vLLM engine argument" in err
    assert "did you mean max_num_seqs?" in err and "starting" not in err


@pytest.mark.slow
def test_an_instance_that_cannot_start_stops_serve_at_once_with_its_error(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    started = time.monotonic()
    assert serve_main(["--port", "0", "--engine", "sim", "--dashboard-address", "127.0.0.1:0",
                       "--profile", "no-such-profile"]) == 1
    assert time.monotonic() - started < 60  # not the 600 s startup timeout
    assert "failed to start: ValueError: unknown latency profile 'no-such-profile'" in capsys.readouterr().err


def test_a_port_in_use_fails_before_any_instance_starts_and_says_what_to_do(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        assert serve_main(["--port", str(port), "--engine", "sim", "--dashboard-address", "127.0.0.1:0"]) == 2
    err = capsys.readouterr().err
    assert f"cannot listen on 127.0.0.1:{port}" in err and "--port 0 any free one" in err and "starting" not in err


def test_without_vllm_the_default_falls_back_to_sim_and_says_why(capsys):
    from functools import partial

    from llumdask.api import serve

    absent = partial(serve.VllmCheck, unavailable="vllm is not installed")
    assert serve.pick_engine(None, absent)[0] == "sim"
    err = capsys.readouterr().err
    assert "not using vLLM: vllm is not installed" in err and "serving with the sim engine instead" in err
    with pytest.raises(ValueError, match="--engine vllm: vllm is not installed"):
        serve.pick_engine("vllm", absent)
    with pytest.raises(ValueError, match="llumdask.x is wrong"):
        serve.pick_engine(None, partial(serve.VllmCheck, bad_argument="llumdask.x is wrong"))


def test_local_instances_share_their_device_unless_the_user_chose():
    from llumdask.api.serve import VllmCheck, memory_share
    from llumdask.config import VllmEngineConfig

    gib = 2**30
    model = VllmEngineConfig(model="/models/m")
    cpu = VllmCheck(device="cpu", free_bytes=20 * gib, total_bytes=24 * gib)
    assert memory_share(model, 2, cpu) == {"kv-cache-memory-bytes": 5 * gib}
    # A CPU instance takes no more than its sequences can fill (rounded up to a MiB).
    small = replace(cpu, usable_kv_bytes=gib + 1)
    assert memory_share(model, 2, small) == {"kv-cache-memory-bytes": gib + 2**20}
    assert memory_share(model, 2, replace(cpu, usable_kv_bytes=64 * gib)) == {"kv-cache-memory-bytes": 5 * gib}
    gpu = VllmCheck(device="cuda", free_bytes=80 * gib, total_bytes=80 * gib)
    assert memory_share(model, 2, gpu) == {"gpu-memory-utilization": 0.45}
    assert memory_share(model, 4, gpu) == {"gpu-memory-utilization": 0.22}
    # One instance, the user's own choice, or the tiny model's fixed cache: vLLM's settings stand.
    assert memory_share(model, 1, gpu) == {}
    assert memory_share(VllmEngineConfig(model="/m", gpu_memory_utilization=0.3), 2, gpu) == {}
    assert memory_share(VllmEngineConfig(model="/m", kv_cache_memory_bytes=gib), 2, cpu) == {}
    assert memory_share(VllmEngineConfig(), 2, cpu) == {}
    with pytest.raises(ValueError, match="cannot share the cpu device"):
        memory_share(model, 8, VllmCheck(device="cpu", free_bytes=gib, total_bytes=24 * gib))


def test_a_tokenizer_of_its_own_serves_the_gateway_and_reaches_the_vllm_engines(tmp_path, monkeypatch):
    """`--tokenizer`, as vLLM's flag: the gateway encodes with it (the engines get it as their own)."""
    from modelcopies import with_thinking_tokens

    from llumdask.api.gateway.tokenizer import model_location

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    model = model_location(None)
    other = with_thinking_tokens(Path(model), tmp_path / "other")
    monkeypatch.chdir(tmp_path)
    served = served_tokenizer(model, "other", {})
    assert served.source == served.files == str(other.resolve())
    assert served.tokenizer.encode("<think>", add_special_tokens=False) == [512]
    assert served_tokenizer(model, None, {}).tokenizer.encode("<think>", add_special_tokens=False) != [512]
    assert served_tokenizer(model, None, {"revision": "v2"}).files == model  # a directory has no revisions


@pytest.fixture
def hub(tmp_path, monkeypatch) -> Path:
    """A hub cache, read offline, holding some-org/tiny at two revisions: main (the tiny model) and
    the branch v2 (with thinking tokens, a generation config of its own and a shorter context)."""
    import json
    import shutil

    import huggingface_hub.constants
    from modelcopies import with_thinking_tokens

    from llumdask.api.gateway.tokenizer import model_location

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    repo = tmp_path / "hub" / "models--some-org--tiny"
    for branch, commit in (("main", "a" * 40), ("v2", "b" * 40), ("nameless", "c" * 40)):
        snapshot = repo / "snapshots" / commit
        if branch == "v2":
            with_thinking_tokens(Path(model_location(None)), snapshot)
            (snapshot / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "eos_token_id": [1, 7]}))
            config = json.loads((snapshot / "config.json").read_text())
            (snapshot / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1024}))
        else:
            shutil.copytree(model_location(None), snapshot)
        if branch == "nameless":  # declares no context length
            for name, key in (("config.json", "max_position_embeddings"), ("tokenizer_config.json", "model_max_length")):
                config = json.loads((snapshot / name).read_text())
                (snapshot / name).write_text(json.dumps({k: v for k, v in config.items() if k != key}))
        (repo / "refs").mkdir(exist_ok=True)
        (repo / "refs" / branch).write_text(commit)
    # The listing of v2's files the hub cache keeps from an earlier download: files the gateway
    # does not read (a README) or that nothing fetched (vocab.txt) are not in the cache.
    listing = {p.name: {"size": p.stat().st_size, "blob_id": "0" * 40} for p in (repo / "snapshots" / ("b" * 40)).iterdir()}
    (repo / "trees").mkdir()
    (repo / "trees" / f"{'b' * 40}.json").write_text(json.dumps({"format_version": 1, "files": {
        **listing, "README.md": {"size": 9, "blob_id": "1" * 40}, "vocab.txt": {"size": 9, "blob_id": "2" * 40}}}))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    # And for the processes serve starts (vLLM's check of the engine arguments).
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return repo


def test_a_hub_model_is_read_at_the_revision_its_engines_load(hub):
    """vLLM's `--revision` (and `--tokenizer-revision`, else the model's): the gateway reads the
    tokenizer, context and generation config of that revision, from its snapshot in the hub cache."""
    from llumdask.api.gateway.generation_config import read_generation_config
    from llumdask.api.gateway.tokenizer import files_at
    from llumdask.api.serve import declared_context

    think = [512]
    at_v2 = served_tokenizer("some-org/tiny", None, {"revision": "v2"})
    assert at_v2.source == "some-org/tiny" and at_v2.files == str(hub / "snapshots" / ("b" * 40))
    assert at_v2.tokenizer.encode("<think>", add_special_tokens=False) == think
    assert served_tokenizer("some-org/tiny", None, {"revision": "main"}).tokenizer.encode(
        "<think>", add_special_tokens=False) != think
    assert served_tokenizer("some-org/tiny", None, {"revision": "main", "tokenizer_revision": "v2"}).tokenizer.encode(
        "<think>", add_special_tokens=False) == think
    assert served_tokenizer("some-org/tiny", None, {"revision": "b" * 40}).files == at_v2.files  # a commit too
    files = files_at("some-org/tiny", "v2")
    assert declared_context(files) == 1024 and declared_context(files_at("some-org/tiny", "main")) == 4096
    assert read_generation_config(files).eos_token_ids == (1, 7)
    with pytest.raises(ValueError, match="cannot read some-org/tiny at revision v3"):
        served_tokenizer("some-org/tiny", None, {"revision": "v3"})


def test_a_revision_with_none_of_the_files_the_gateway_reads_is_named(tmp_path, monkeypatch):
    """Online, the hub names the snapshot of a repository holding only weights (GGUF files, say)
    though it fetched nothing into it: a clear error, not a failure to read that path."""
    import huggingface_hub

    from llumdask.api.gateway.tokenizer import files_at

    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *args, **kwargs: str(tmp_path / "never-made"))
    with pytest.raises(ValueError, match="some-org/gguf at revision v1 has none of the files the gateway reads"):
        files_at("some-org/gguf", "v1")


def test_serve_reads_the_model_s_own_files_at_its_revision(hub, capsys):
    """The context length too: a revision that declares none stops serve (the default one declares one;
    read there, serve would go on to vLLM's check of a misspelt option, which stops it too)."""
    assert serve_main(["--port", "0", "--engine", "vllm", "--model", "some-org/tiny", "--revision", "nameless",
                       "--no-such-vllm-option", "1"]) == 2
    assert "declares no context length; pass --max-model-len" in capsys.readouterr().err


@pytest.mark.vllm
def test_serve_reads_a_hub_model_at_its_revision_and_starts_its_instances_there(hub, capsys, monkeypatch):
    """`llumdask serve --model NAME --revision R` (stopped where it starts the local cluster): the
    gateway reads that revision's files, and the instances get the name and the revision, which
    vLLM's check of the engine arguments resolved in the same cache."""
    import llumdask.clusters.local
    from llumdask.clusters.instances import InstanceStartupError

    started: list[dict] = []

    def local_cluster(instances, engine, overrides, **kwargs):
        started.append(overrides)
        raise InstanceStartupError("stopped by the test")

    monkeypatch.setattr(llumdask.clusters.local, "local_cluster", local_cluster)
    assert serve_main(["--port", "0", "--engine", "vllm", "--model", "some-org/tiny", "--revision", "v2"]) == 1
    err = capsys.readouterr().err
    assert "stopped by the test" in err, err[-3000:]
    engine = started[-1]["vllm-engine"]
    assert engine["model"] == "some-org/tiny" and engine["engine-args"]["revision"] == "v2"


def test_the_notebook_client_reads_the_configured_tokenizer_at_its_revision(hub):
    """Without a model given, the client reads the configured model with the tokenizer and
    revisions its engine arguments name, as `llumdask serve` does."""
    import dask.config
    from distributed import Client

    from llumdask.api.client import LlumdaskClient

    with Client(processes=False, n_workers=0, dashboard_address=None) as dask_client:
        for engine_args, think in (({"revision": "v2"}, True), ({}, False), ({"tokenizer-revision": "v2"}, True)):
            with dask.config.set({"llumdask.vllm-engine": {"model": "some-org/tiny", "engine-args": engine_args}}):
                encoded = LlumdaskClient(dask_client).tokenizer.encode("<think>", add_special_tokens=False)
            assert (encoded == [512]) is think, engine_args
