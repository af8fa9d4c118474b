"""deploy/: the Helm chart renders, its manifests are valid Kubernetes objects, and what they name
(commands, flags, probe paths and ports, the autoscaling metric) is what our image and server
really run and export.

No helm binary is installable here, but the helm-sdkpy wheel links helm v4 as a library, with
lint and no `template`: its lint checks the chart, and through lint it also renders every
template (chart_copy), which must give the objects tests/deploy/gotemplate.py renders. The tests
use the Python renderer for the rest, and every core object is validated against Kubernetes' own
OpenAPI schemas (kubernetes-validate, strict: unknown fields fail) for the oldest and newest
versions we support.
"""

from __future__ import annotations

import ast
import inspect
import json
import re
import shlex
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import kubernetes_validate
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from ensemble.__main__ import main as ensemble_main
from ensemble.__main__ import make_parser
from ensemble.server import TritonServer
from ensemble.settings import ServeSettings
from tests.deploy.gotemplate import Chart, TemplateError
from tests.docker.replay import replay
from tests.docker.test_dockerfile import pip_requirements, project_install_index

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
CHART = DEPLOY / "helm" / "tritonllm"
EXPORTER = ROOT / "model_repository" / "tensorrt_llm" / "1" / "llm_metrics.py"
K8S_VERSIONS = ("1.29.0", "1.37.0")
NON_DEFAULT = {
    "replicaCount": 3,
    "gpus": 2,
    "image": {"repository": "registry.example/tritonllm", "tag": "0.2.0"},
    "model": {
        "path": "/models/Llama-3.2-1B-Instruct",
        "volume": {"type": "pvc", "claimName": "llm-models"},
    },
    "engine": {
        "max_batch_size": 128,
        "max_seq_len": 4096,
        "batch_scheduler_policy": "max_utilization",
        "max_tokens_in_paged_kv_cache": 1000000,
        "kv_cache_free_gpu_mem_fraction": 0.85,
        "enable_kv_cache_reuse": False,
    },
    "openai": {"enabled": False},
    "podMonitor": {"enabled": False},
    "autoscaling": {"enabled": False},
    "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
    "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
}
HOST_PATH_KV = {
    "model": {"path": "/models/model.gguf", "volume": {"type": "hostPath", "hostPath": "/data"}},
    "autoscaling": {"metric": "kv_cache_fraction", "maxReplicas": 8},
}
VALUE_SETS = {"default": {}, "non-default": NON_DEFAULT, "host-path-kv": HOST_PATH_KV}

# The fields of the Prometheus Operator's PodMonitor (monitoring.coreos.com/v1) that the chart
# sets, with their types from its CRD: the core schemas do not cover custom resources.
POD_MONITOR_SPEC = {
    "selector": dict,
    "podMetricsEndpoints": list,
}
POD_METRICS_ENDPOINT = {"port": str, "path": str, "interval": str}


@pytest.fixture(scope="module")
def chart() -> Chart:
    return Chart(CHART)


def by_kind(manifests: list[dict]) -> dict[str, dict]:
    kinds = [m["kind"] for m in manifests]
    assert len(kinds) == len(set(kinds)), kinds
    return {m["kind"]: m for m in manifests}


def containers(manifests: list[dict]) -> dict[str, dict]:
    spec = by_kind(manifests)["Deployment"]["spec"]["template"]["spec"]
    return {c["name"]: c for c in spec.get("initContainers", []) + spec["containers"]}


def flag(args: list[str], name: str) -> str:
    """The value of `--name=value` or `--name value` in a command line."""
    for i, arg in enumerate(args):
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
        if arg == name:
            return args[i + 1]
    raise AssertionError(f"{name} not in {args}")


def validate_core(manifest: dict) -> None:
    for version in K8S_VERSIONS:
        try:
            kubernetes_validate.validate(manifest, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            path = "/".join(map(str, exc.path))
            pytest.fail(f"{manifest['kind']} invalid for {version} at {path}: {exc.message}")


def validate_pod_monitor(manifest: dict) -> None:
    assert manifest["apiVersion"] == "monitoring.coreos.com/v1"
    spec = manifest["spec"]
    assert set(spec) <= set(POD_MONITOR_SPEC), spec
    for key, kind in POD_MONITOR_SPEC.items():
        assert isinstance(spec[key], kind), (key, spec[key])
    for endpoint in spec["podMetricsEndpoints"]:
        assert set(endpoint) <= set(POD_METRICS_ENDPOINT), endpoint
        assert all(isinstance(endpoint[k], t) for k, t in POD_METRICS_ENDPOINT.items())
        assert re.fullmatch(r"(\d+(ms|s|m|h))+", endpoint["interval"]), endpoint["interval"]


def exported_gauges() -> dict[str, tuple[str, tuple[str, ...]]]:
    """{family: (label, label values)} of the gauges llm_metrics.py registers (read, not run:
    it needs Triton's pb_utils)."""
    gauges = {}
    for node in ast.walk(ast.parse(EXPORTER.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "_gauges":
            name, _, label, values = (ast.literal_eval(a) for a in node.args)
            gauges[name] = (label, values)
    assert gauges, f"no gauges found in {EXPORTER}"
    return gauges


def adapter_rules() -> dict[str, dict]:
    values = yaml.safe_load((DEPLOY / "prometheus-adapter-values.yaml").read_text())
    return {rule["name"]["as"]: rule for rule in values["rules"]["custom"]}


# ---- rendering and validation ------------------------------------------------------------------
@pytest.mark.parametrize("values", VALUE_SETS.values(), ids=VALUE_SETS.keys())
def test_every_manifest_renders_and_validates(chart, values):
    manifests = chart.manifests(values)
    kinds = by_kind(manifests)
    assert {"Deployment", "Service"} <= kinds.keys()
    for manifest in manifests:
        if manifest["kind"] == "PodMonitor":
            validate_pod_monitor(manifest)
        else:
            validate_core(manifest)


def test_default_values_deploy_the_whole_stack(chart):
    kinds = by_kind(chart.manifests())
    assert kinds.keys() == {"Deployment", "Service", "PodMonitor", "HorizontalPodAutoscaler"}
    assert "replicas" not in kinds["Deployment"]["spec"]  # the HPA owns the replica count
    assert {p["name"] for p in kinds["Service"]["spec"]["ports"]} == {
        "http",
        "grpc",
        "metrics",
        "openai",
    }


def test_non_default_values_reach_the_manifests(chart):
    manifests = chart.manifests(NON_DEFAULT)
    kinds = by_kind(manifests)
    assert kinds.keys() == {"Deployment", "Service"}
    deployment = kinds["Deployment"]
    assert deployment["spec"]["replicas"] == 3
    pod = deployment["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == NON_DEFAULT["nodeSelector"]
    assert pod["tolerations"] == NON_DEFAULT["tolerations"]
    assert {
        "name": "model",
        "persistentVolumeClaim": {"claimName": "llm-models", "readOnly": True},
    } in pod["volumes"]
    found = containers(manifests)
    assert found.keys() == {"build-repository", "tritonserver"}  # no OpenAI front end
    server, build = found["tritonserver"], found["build-repository"]
    assert server["image"] == "registry.example/tritonllm:0.2.0"
    assert server["resources"]["limits"]["nvidia.com/gpu"] == 2
    for each in (server, build):
        assert {"name": "model", "mountPath": "/models", "readOnly": True} in each["volumeMounts"]
    assert flag(build["args"], "--model") == "/models/Llama-3.2-1B-Instruct"
    assert flag(build["args"], "--max-batch-size") == "128"
    assert flag(build["args"], "--max-seq-len") == "4096"
    assert flag(build["args"], "--batch-scheduler-policy") == "max_utilization"
    assert flag(build["args"], "--max-tokens-in-paged-kv-cache") == "1000000"
    assert flag(build["args"], "--kv-cache-free-gpu-mem-fraction") == "0.85"
    assert flag(build["args"], "--enable-kv-cache-reuse") == "false"


def test_host_path_model_and_kv_cache_autoscaling(chart):
    kinds = by_kind(chart.manifests(HOST_PATH_KV))
    volumes = kinds["Deployment"]["spec"]["template"]["spec"]["volumes"]
    assert {"name": "model", "hostPath": {"path": "/data", "type": "Directory"}} in volumes
    hpa = kinds["HorizontalPodAutoscaler"]["spec"]
    assert hpa["maxReplicas"] == 8
    assert hpa["metrics"][0]["pods"]["metric"]["name"] == "tritonllm_kv_cache_used_fraction"
    assert hpa["metrics"][0]["pods"]["target"]["averageValue"] == "800m"


def test_an_unknown_autoscaling_metric_is_refused_by_name(chart):
    with pytest.raises(TemplateError, match="autoscaling.metric must be waiting or kv_cache"):
        chart.manifests({"autoscaling": {"metric": "gpu_util"}})


HELM_LINT = """
import asyncio, json, sys
from helm_sdkpy import Configuration
from helm_sdkpy.chart import Lint
config = Configuration()
print(json.dumps([asyncio.run(Lint(config).run(path)) for path in sys.argv[1:]]))
"""
ERROR_SEVERITY = 2  # helm's lint severities: 1 info, 2 warning, 3 error
HELM_RELEASE = "test-release"  # the release name helm lint renders with
RENDERED = re.compile(r'fail message=("(?:[^"\\]|\\.)*")')


def chart_copy(dest: Path, values: dict, expose: bool) -> Path:
    """The chart with `values` merged into values.yaml. expose: each template's text becomes the
    message of a `fail`, which helm's lint logs instead of failing, so its rendering comes back."""
    copy = shutil.copytree(CHART, dest)
    merged = Chart(CHART).render_values(values)
    (copy / "values.yaml").write_text(yaml.safe_dump(merged, sort_keys=False))
    if expose:
        defines = []
        for template in sorted((copy / "templates").glob("[!_]*")):
            name = f"{dest.parent.name}/{template.name}"
            defines.append(f'{{{{ define "{name}" }}}}{template.read_text()}{{{{ end }}}}')
            template.write_text(f'{{{{ fail (printf "%s %s" "{name}" (include "{name}" .)) }}}}')
        (copy / "templates" / "_exposed.tpl").write_text("".join(defines))
    return copy


@pytest.fixture(scope="module")
def helm(tmp_path_factory) -> dict[str, tuple[dict, dict[str, str]]]:
    """{value set: (helm lint's result, {template: helm's rendering})}: real helm (v4, linked
    into the helm-sdkpy wheel), in a process of its own (Go runtime)."""
    root = tmp_path_factory.mktemp("helm")
    plain = [chart_copy(root / name / "plain", v, False) for name, v in VALUE_SETS.items()]
    exposed = [chart_copy(root / name / "exposed", v, True) for name, v in VALUE_SETS.items()]
    run = subprocess.run(
        [sys.executable, "-c", HELM_LINT, *map(str, plain + exposed)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    rendered: dict[str, dict[str, str]] = {name: {} for name in VALUE_SETS}
    for message in RENDERED.findall(run.stderr):
        key, _, text = json.loads(message).partition(" ")
        name, template = key.split("/")
        rendered[name][template] = text
    results = json.loads(run.stdout.splitlines()[-1])[: len(plain)]
    return {name: (results[i], rendered[name]) for i, name in enumerate(VALUE_SETS)}


@pytest.mark.parametrize("name", VALUE_SETS)
def test_helm_itself_lints_the_chart(helm, name):
    result, _ = helm[name]
    assert result["TotalChartsLinted"] == 1
    problems = [m["Path"] for m in result["Messages"] if m["Severity"] >= ERROR_SEVERITY]
    # helm-sdkpy passes Go errors on without their text: `helm lint` on the chart says why.
    assert not problems and not result["Errors"], f"{name}: helm lint fails on {problems}"


@pytest.mark.parametrize("name", VALUE_SETS)
def test_helm_renders_the_objects_our_renderer_does(chart, helm, name):
    _, rendered = helm[name]
    ours = chart.render(VALUE_SETS[name], release=HELM_RELEASE)
    assert rendered.keys() == ours.keys()
    for template, text in ours.items():
        theirs = [d for d in yaml.safe_load_all(rendered[template]) if d]
        assert theirs == [d for d in yaml.safe_load_all(text) if d], template


# ---- what the manifests name is what the server runs and exports -------------------------------
@pytest.mark.parametrize("metric", ["waiting", "kv_cache_fraction"])
def test_the_hpa_scales_on_a_series_our_server_exports(chart, metric):
    hpa = by_kind(chart.manifests({"autoscaling": {"metric": metric}}))["HorizontalPodAutoscaler"]
    name = hpa["spec"]["metrics"][0]["pods"]["metric"]["name"]
    rule = adapter_rules()[name]  # prometheus-adapter serves it under this name
    family, selector = re.fullmatch(r"(\w+)\{(.*)\}", rule["seriesQuery"]).groups()
    label, value = re.match(r'(\w+)="(\w+)"', selector).groups()
    gauges = exported_gauges()
    assert family in gauges, f"{family} is not a gauge of {EXPORTER.name}: {sorted(gauges)}"
    assert gauges[family] == (label, gauges[family][1]) and value in gauges[family][1]
    assert re.search(rf"^\^{family}\$$", rule["name"]["matches"])
    assert f'{label}="{value}"' in rule["metricsQuery"]  # the query keeps to that one series
    assert rule["resources"]["overrides"]["pod"] == {"resource": "pod"}  # a per-pod metric


def test_probes_and_ports_are_those_the_server_uses(chart):
    manifests = chart.manifests()
    server = containers(manifests)["tritonserver"]
    ports = {p["name"]: p["containerPort"] for p in server["ports"]}
    defaults = ServeSettings()
    assert ports == {
        "http": defaults.http_port,
        "grpc": defaults.grpc_port,
        "metrics": defaults.metrics_port,
    }
    for name in ("http", "grpc", "metrics"):
        assert flag(server["args"], f"--{name}-port") == str(ports[name])
    # `python -m ensemble serve` waits for readiness on this path of the HTTP port.
    assert '/v2/health/ready"' in inspect.getsource(TritonServer.is_ready)
    for probe in ("startupProbe", "readinessProbe"):
        assert server[probe]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert server["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    monitor = by_kind(manifests)["PodMonitor"]["spec"]["podMetricsEndpoints"][0]
    assert (monitor["port"], monitor["path"]) == ("metrics", "/metrics")
    service = {p["name"]: p for p in by_kind(manifests)["Service"]["spec"]["ports"]}
    for name, port in ports.items():
        assert service[name]["port"] == port and service[name]["targetPort"] == name
    openai = containers(manifests)["openai"]
    assert service["openai"]["port"] == openai["ports"][0]["containerPort"] == 9000


def test_the_containers_run_commands_of_our_image(chart, tmp_path):
    """The server container runs the image's entry point, the launcher (`python3 -m ensemble
    serve`, which drains the engine on SIGTERM), whose own parser accepts every rendered argument,
    over the repository the init container builds; that `python3 -m ensemble build`, which the
    image's own build runs too, accepts every rendered argument: run here, it builds."""
    image = replay(tmp_path / "recipe", execute=False)
    found = containers(chart.manifests({"engine": NON_DEFAULT["engine"]}))
    server, build = found["tritonserver"], found["build-repository"]
    assert server["command"] == image.cmd[:1] == ["python3"]
    assert server["args"][:3] == image.cmd[1:4] == ["-m", "ensemble", "serve"]
    served = make_parser().parse_args(server["args"][2:])
    assert served.openai_port == 0  # the front end has a container of its own
    assert str(served.repository) == flag(build["args"], "--out")
    assert any(cmd[:3] == ["python3", "-m", "ensemble"] for cmd in image.ran), image.ran
    assert build["command"] == ["python3"] and build["args"][:3] == ["-m", "ensemble", "build"]
    args = build["args"][2:]
    out = tmp_path / "repository"
    args[args.index("--out") + 1] = str(out)
    assert ensemble_main(args) == 0
    config = (out / "tensorrt_llm" / "config.pbtxt").read_text()
    for name in ("max_batch_size", "max_seq_len", "max_tokens_in_paged_kv_cache"):
        value = flag(args, "--" + name.replace("_", "-"))
        assert re.search(rf'key: "{name}"\s*value: {{\s*string_value: "{value}"', config), name


def installed_closure(roots: list[Requirement]) -> set[str]:
    """The distributions `roots` install, with their dependencies (read from this environment's
    metadata, which holds them all)."""
    seen: set[str] = set()
    todo = [(r, frozenset(r.extras)) for r in roots]
    while todo:
        req, extras = todo.pop()
        name = canonicalize_name(req.name)
        if name in seen and not extras:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(req.name) or []
        except metadata.PackageNotFoundError:  # an optional dependency this environment lacks
            continue
        for line in requires:
            dep = Requirement(line)
            wanted = dep.marker is None or any(
                dep.marker.evaluate({"extra": e}) for e in extras or {""}
            )
            if wanted:
                todo.append((dep, frozenset(dep.extras)))
    return seen


def test_the_openai_container_uses_the_front_end_options(chart):
    module = ROOT / "ensemble" / "openai_server"
    if not module.is_dir():
        pytest.skip("ensemble/openai_server is not in this checkout")
    openai = containers(chart.manifests())["openai"]
    assert openai["command"] == ["python3"] and openai["args"][:2] == [
        "-m",
        "ensemble.openai_server",
    ]
    usage = subprocess.run(
        [sys.executable, "-m", "ensemble.openai_server", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert usage.returncode == 0, usage.stderr
    for option in (a for a in openai["args"] if a.startswith("--")):
        assert option in usage.stdout, option


# ---- KServe ------------------------------------------------------------------------------------
def test_kserve_runtime_serves_the_example_inference_service(tmp_path):
    runtime = yaml.safe_load((DEPLOY / "kserve" / "servingruntime.yaml").read_text())
    service = yaml.safe_load((DEPLOY / "kserve" / "inferenceservice.yaml").read_text())
    assert runtime["apiVersion"] == "serving.kserve.io/v1alpha1"
    assert service["apiVersion"] == "serving.kserve.io/v1beta1"
    model = service["spec"]["predictor"]["model"]
    assert model["runtime"] == runtime["metadata"]["name"]
    assert model["modelFormat"]["name"] in {
        f["name"] for f in runtime["spec"]["supportedModelFormats"]
    }
    # A ServingRuntime's containers and volumes are a pod's: validate them as one.
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "servingruntime"},
        "spec": {
            "containers": runtime["spec"]["containers"],
            "volumes": runtime["spec"]["volumes"],
        },
    }
    validate_core(pod)
    (container,) = runtime["spec"]["containers"]
    assert container["command"] == ["/bin/sh", "-c"]
    build, serve = (shlex.split(part) for part in container["args"][0].split("&&"))
    assert build[:3] == ["python3", "-m", "ensemble"] and serve[:2] == ["exec", "tritonserver"]
    http = int(flag(serve, "--http-port"))
    assert container["ports"] == [{"containerPort": http, "protocol": "TCP"}]
    assert container["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": http}
    assert flag(serve, "--model-repository") == flag(build, "--out")
    assert runtime["spec"]["annotations"]["prometheus.kserve.io/port"] == flag(
        serve, "--metrics-port"
    )
    assert flag(build, "--model") == "/mnt/models"  # where KServe puts the storageUri
    args = build[3:]
    args[args.index("--model") + 1] = "default"  # no /mnt/models here
    args[args.index("--out") + 1] = str(tmp_path / "repository")
    assert ensemble_main(args) == 0


def test_the_image_installs_what_the_openai_front_end_imports(tmp_path):
    module = ROOT / "ensemble" / "openai_server"
    if not module.is_dir():
        pytest.skip("ensemble/openai_server is not in this checkout")
    image = replay(tmp_path / "recipe", execute=False)
    project = image.pip_installs[project_install_index(image)]
    extras = {e for a in project for e in re.findall(r"\[([^\]]+)\]", a) for e in e.split(",")}
    roots = [Requirement(f"tritonllm[{','.join(sorted(extras))}]")]
    roots += [r for args in image.pip_installs for r in pip_requirements(args)]
    installed = installed_closure(roots)
    ours = {"backend", "ensemble", "preprocessing", "postprocessing"}
    distributions = metadata.packages_distributions()
    for path in module.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in getattr(node, "names", [])] if isinstance(node, ast.Import) else []
            )
            if isinstance(node, ast.ImportFrom) and node.level == 0:
                names = [node.module]
            for top in {n.split(".")[0] for n in names} - ours - set(sys.stdlib_module_names):
                dists = {canonicalize_name(d) for d in distributions.get(top, [top])}
                assert dists & installed, f"{path.name} imports {top}, which the image lacks"
