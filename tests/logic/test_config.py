from __future__ import annotations

import pytest
import yaml

from pdserve_core.config import ConfigError, PDServeConfig, load_config, parse_config, with_settings
from tests.conftest import REPO


def test_defaults_are_the_local_cpu_example():
    assert load_config(REPO / "deploy/config/local-cpu.yaml") == PDServeConfig()
    assert load_config(None) == PDServeConfig()


def test_every_example_config_under_deploy_is_valid():
    examples = sorted((REPO / "deploy").rglob("config/*.yaml"))
    assert examples
    for path in examples:
        data = yaml.safe_load(path.read_text())
        if str(data.get("model", "")).startswith("/models/"):  # a cluster host's path
            data["model"] = "default"
        parse_config(data, str(path))


@pytest.mark.parametrize(
    ("data", "field", "reason"),
    [
        ({"engine": {"max_model_len": 0}}, "engine.max_model_len", "greater than 0"),
        ({"engine": {"dtype": "int3"}}, "engine.dtype", "'bfloat16'"),
        ({"engine": {"max_len": 10}}, "engine.max_len", "Extra inputs are not permitted"),
        ({"router": {"http_port": 70000}}, "router.http_port", "less than or equal to 65535"),
        (
            {"kv_transfer": {"transport": "udp"}},
            "kv_transfer.transport",
            "'tcp', 'nccl', 'gloo' or 'nixl'",
        ),
        (
            {"kv_transfer": {"failure_policy": "ignore"}},
            "kv_transfer.failure_policy",
            "'recompute'",
        ),
        ({"model": "/no/such/folder"}, "model", "not a local model folder"),
        (
            {"mode": "colocated", "pools": {"colocated": {"replicas": 0}}},
            "(top level)",
            "colocated.replicas >= 1",
        ),
        ({"mode": "disaggregated", "pools": {"decode": {"replicas": 0}}}, "(top level)", "decode"),
        (
            {"pools": {"autoscale": {"enabled": True, "min_prefill": 1, "min_decode": 2}}},
            "(top level)",
            "more than the 2 nodes",
        ),
        (
            {"mode": "colocated", "pools": {"autoscale": {"enabled": True}}},
            "(top level)",
            "needs mode 'disaggregated'",
        ),
        ({"pools": {"autoscale": {"high": 1.0}}}, "pools.autoscale.high", "greater than 1"),
        ({"pools": {"autoscale": {"min_decode": 0}}}, "pools.autoscale.min_decode", "1"),
        ({"router": {"replicas": 0}}, "router.replicas", "greater than or equal to 1"),
        ({"pools": {"decode": {"cpu_bind": ["0|1"]}}}, "pools.decode.cpu_bind", "not a list of"),
        ({"pools": {"prefill": {"cpu_bind": ["all"]}}}, "pools.prefill.cpu_bind", '"nobind"'),
        ({"pools": {"colocated": {"cpu_bind": ["0-"]}}}, "pools.colocated.cpu_bind", "'0-'"),
        ({"pools": {"colocated": {"cpu_bind": ["3-1"]}}}, "pools.colocated.cpu_bind", "backwards"),
        (
            {"router": {"replicas": 4, "http_port": 8000, "grpc_port": 8002}},
            "(top level)",
            "the HTTP ports 8000-8003 and the gRPC ports 8002-8005 overlap",
        ),
        (
            {"router": {"replicas": 3, "http_port": 65534}},
            "(top level)",
            "router.http_port 65534 + 3 routers passes port 65535",
        ),
    ],
)
def test_bad_values_name_the_field_and_reason(data, field, reason):
    with pytest.raises(ConfigError) as caught:
        parse_config(data, "test.yaml")
    message = str(caught.value)
    assert "test.yaml" in message
    assert f"{field}:" in message
    assert reason in message


def test_each_form_of_core_list_a_pool_may_bind_to_is_accepted():
    binds = ["0", "1-3", "0,2-3,5", "nobind"]
    config = parse_config({"pools": {"prefill": {"cpu_bind": binds}}}, "test.yaml")
    assert config.pools.prefill.cpu_bind == binds


def test_several_routers_take_consecutive_ports_or_free_ones():
    routers = parse_config({"router": {"replicas": 3, "http_port": 0, "grpc_port": 0}}).router
    assert routers.replicas == 3  # port 0: a free port for each, nothing to overlap
    assert parse_config({"router": {"replicas": 3}}).router.http_port == 8000  # 8000-8002


def test_a_local_model_folder_is_accepted(tmp_path):
    config = parse_config({"model": str(tmp_path)})
    assert config.model == str(tmp_path)


def test_file_errors_are_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="cannot read config"):
        load_config(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("engine: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="mapping at the top level"):
        load_config(scalar)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    assert load_config(empty) == PDServeConfig()


def test_cli_rejects_a_bad_config_before_starting_anything(tmp_path, capsys):
    from pdserve.cli import main

    bad = tmp_path / "bad.yaml"
    bad.write_text("router:\n  http_port: -1\n")
    assert main(["serve", "--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "router.http_port" in err and "greater than or equal to 0" in err


def test_cli_routers_flag_is_router_replicas(capsys):
    from pdserve.cli import main

    ports = ["--set", "router.http_port=8000", "--set", "router.grpc_port=8001"]
    code = main(["serve", "--routers", "2", *ports])
    assert code == 2
    assert "the HTTP ports 8000-8001 and the gRPC ports 8001-8002 overlap" in (
        capsys.readouterr().err
    )


def test_the_api_key_comes_from_the_environment_and_a_public_bind_needs_one(monkeypatch, capsys):
    from pdserve.cli import main
    from pdserve_core.config import PDServeConfig

    monkeypatch.setenv("PDSERVE_API_KEY", "from-env")
    assert PDServeConfig().router.api_key == "from-env"
    monkeypatch.delenv("PDSERVE_API_KEY")
    assert PDServeConfig().router.api_key is None
    assert main(["serve", "--host", "0.0.0.0"]) == 2
    assert "without an API key" in capsys.readouterr().err


def test_cpu_engines_preload_what_is_installed(monkeypatch, tmp_path, caplog):
    """`engine.cpu_preload` becomes the engine actors' LD_PRELOAD with the files found; a
    library not installed is left out with a warning; GPU pools and [] preload nothing."""
    from pdserve_core import config as config_module
    from pdserve_core.config import EngineConfig, PoolConfig
    from pdserve_core.engine.actor import engine_env

    lib = tmp_path / "libiomp5.so"
    lib.write_bytes(b"")
    monkeypatch.setitem(config_module.CPU_PRELOADS, "iomp", (str(tmp_path / "libiomp*.so"),))
    monkeypatch.setitem(config_module.CPU_PRELOADS, "tcmalloc", (str(tmp_path / "none*.so"),))
    engine = EngineConfig()
    assert engine.cpu_preload == ["tcmalloc", "iomp"]
    with caplog.at_level("WARNING"):
        env = engine_env(engine, PoolConfig(), 0)
    assert env["LD_PRELOAD"] == str(lib)
    assert "tcmalloc is not installed" in caplog.text
    assert "LD_PRELOAD" not in engine_env(EngineConfig(cpu_preload=[]), PoolConfig(), 0)
    assert "LD_PRELOAD" not in engine_env(engine, PoolConfig(num_gpus=1), 0)


def test_tls_files_are_checked_at_load_and_reach_the_connector(tmp_path):
    from tests.helpers.certs import issue

    missing = str(tmp_path / "nowhere.pem")
    with pytest.raises(ConfigError) as bad:
        parse_config({"router": {"tls": {"cert_file": missing, "key_file": missing}}})
    assert "router.tls" in str(bad.value) and "nowhere.pem" in str(bad.value)
    files = issue(tmp_path / "certs")
    config = parse_config(
        {
            "router": {"tls": {"cert_file": files.cert_file, "key_file": files.key_file}},
            "kv_transfer": {
                "tls": {
                    "cert_file": files.cert_file,
                    "key_file": files.key_file,
                    "ca_file": files.ca_file,
                    "check_hostname": False,
                }
            },
        }
    )
    settings = config.kv_transfer.connector_settings("secret", 0)
    assert settings.tls_ca_file == files.ca_file and not settings.tls_check_hostname
    assert settings.server_tls() is not None and settings.client_tls() is not None
    assert PDServeConfig().kv_transfer.connector_settings("s", 0).server_tls() is None


def test_plain_text_off_loopback_is_warned_about(monkeypatch, capsys):
    from pdserve import cli

    monkeypatch.setattr("pdserve.serve.run", lambda config, ready_file=None: 0)
    monkeypatch.setenv("PDSERVE_API_KEY", "k")
    assert cli.main(["serve", "--host", "0.0.0.0"]) == 0
    assert "serving plain text on 0.0.0.0" in capsys.readouterr().err


def test_set_reaches_any_field_by_its_path_and_refuses_what_the_schema_does(monkeypatch, capsys):
    from pdserve import cli
    from pdserve_core.config import with_settings

    config = with_settings(
        PDServeConfig(),
        ["kv_transfer.transport=nixl", "kv_transfer.ucx={TLS: tcp}", "pools.decode.replicas=2"],
    )
    assert config.kv_transfer.transport == "nixl" and config.kv_transfer.ucx == {"TLS": "tcp"}
    assert config.pools.decode.replicas == 2
    settings = config.kv_transfer.connector_settings("s", 0)
    assert settings.transport == "nixl" and settings.ucx == {"TLS": "tcp"}
    served = []
    monkeypatch.setattr("pdserve.serve.run", lambda config, ready_file=None: served.append(config))
    cli.main(["serve", "--set", "kv_transfer.transport=nixl"])
    assert served[0].kv_transfer.transport == "nixl"
    for bad, says in (
        ("kv_transfer.transport=udp", "kv_transfer.transport"),
        ("kv_transfer.ucx={tls; rm: x}", "not a UCX variable name"),
        ("kv_transfer.ucx={TLS: 'cuda_ipc,cuda_copy'}", "no transport NIXL can send its messages"),
        ("kv_transfer.nope=1", "kv_transfer.nope"),
        ("transport", "write KEY=VALUE"),
        ("model.x=1", "model is a value, not a section"),
    ):
        assert cli.main(["serve", "--set", bad]) == 2, bad
        assert says in capsys.readouterr().err, bad


def test_a_ucx_transport_list_must_carry_nixls_messages():
    """NIXL's UCX backend needs a transport for its active messages with peer-failure handling:
    a TLS list of copy-only transports failed it at start on an H200 (results/nixl_gpu)."""
    from pdserve_core.kv.settings import ConnectorSettings, check_ucx

    for fine in ("tcp", "rc,cuda_copy,cuda_ipc", "cuda_ipc,cuda_copy,tcp", "^cuda_ipc", "all",
                 "rc_x,dc_mlx5", "ib"):  # fmt: skip
        check_ucx({"TLS": fine})
        check_ucx({"UCX_TLS": fine})
    for bad in ("cuda_ipc,cuda_copy", "sm,self", "cma", "cuda_ipc,cuda_copy,sm,self"):
        with pytest.raises(ValueError, match="no transport NIXL can send its messages over"):
            check_ucx({"UCX_TLS": bad})
        with pytest.raises(ValueError, match="no transport NIXL"):
            ConnectorSettings.from_extra({"transport": "nixl", "ucx": {"TLS": bad}})
    check_ucx({"NET_DEVICES": "cuda_ipc"})  # only TLS names transports


def test_a_small_cpu_host_is_told_which_layout_the_measurements_favour():
    """On two cores the split loses uniform traffic to one engine (results/bench/layouts): the
    default config says so at start, and only where that measurement applies."""
    from pdserve.serve import layout_advice

    default = load_config(REPO / "deploy/config/local-cpu.yaml")
    said = layout_advice(default, host_cores=2)
    assert said and "--set mode=colocated" in said and "2 cores" in said and "1 thread:" in said
    assert layout_advice(default, host_cores=8) is None  # more cores than were measured
    for change in ("mode=colocated", "engine.omp_threads=2", "pools.decode.num_gpus=1",
                   "ray.address=127.0.0.1:6379"):  # fmt: skip
        assert layout_advice(with_settings(default, [change]), host_cores=2) is None, change
