"""The Helm chart helm/ucm-ray: it lints, renders objects Kubernetes and KubeRay accept (built-in
kinds against the Kubernetes schemas, the RayService against KubeRay's CRD, and the fields KubeRay
reads where it reads them), sizes /dev/shm from the tier the app builder reads, refuses bad values
with one clear error, scales by values, and its serveConfigV2 loads and builds the way `serve run`
would (Serve's schema, the builder's checks, Ray Serve LLM's app)."""

from __future__ import annotations

import json

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.support.helm_tools import (
    CHART,
    ROOT,
    VALUES,
    crd_schema,
    group_values,
    helm,
    one,
    quantity_bytes,
    render,
    template,
)
from ucm_ray.config import parse_size
from ucm_ray.serve import prepare_app
from ucm_ray.serve.check import PD_BUILDER, PREPARE
from ucm_ray.serve.pd import prepare_pd_app

K8S_VERSIONS = ("1.25", kubernetes_validate.latest_version())  # Chart.yaml's kubeVersion floor, the newest
BUILT_IN_GROUPS = {"v1", "apps/v1", "batch/v1", "policy/v1", "networking.k8s.io/v1", "rbac.authorization.k8s.io/v1"}


@pytest.fixture(scope="module", params=list(VALUES))
def rendered(request) -> tuple[str, list[dict]]:
    return request.param, render(*VALUES[request.param])


def pod_templates(rayservice: dict) -> dict[str, dict]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    return {"head": cluster["headGroupSpec"]["template"], "worker": cluster["workerGroupSpecs"][0]["template"]}


def shm_bytes(template: dict) -> int:
    (volume,) = [v for v in template["spec"]["volumes"] if v["name"] == "shared-mem"]
    assert volume["emptyDir"]["medium"] == "Memory"
    return quantity_bytes(volume["emptyDir"]["sizeLimit"])


@pytest.mark.parametrize("name", list(VALUES))
def test_lint_strict(name):
    args = [a for f in VALUES[name] for a in ("-f", str(f))]
    done = helm("lint", "--strict", str(CHART), *args)
    assert done.returncode == 0 and "0 chart(s) failed" in done.stdout, done.stdout + done.stderr


def test_every_rendered_object_is_valid(rendered):
    name, objects = rendered
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == (["ConfigMap", "PodMonitor", "RayService"] if name == "gpu" else ["RayService"])
    for obj in objects:
        if obj["apiVersion"] in BUILT_IN_GROUPS:
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(obj, version, strict=True)
        elif obj["kind"] == "RayService":
            assert obj["apiVersion"] == "ray.io/v1"
            jsonschema.validate(obj, crd_schema("rayservices"))
            cluster = {"apiVersion": "ray.io/v1", "kind": "RayCluster", "metadata": {"name": "c"},
                       "spec": obj["spec"]["rayClusterConfig"]}
            jsonschema.validate(cluster, crd_schema("rayclusters"))  # KubeRay builds a RayCluster from it
            # The CRD's pod templates accept unknown fields; the Kubernetes schema of a PodTemplate does not.
            for group, tmpl in pod_templates(obj).items():
                wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": group}, "template": tmpl}
                for version in K8S_VERSIONS:
                    kubernetes_validate.validate(wrapped, version, strict=True)
        else:
            assert obj["apiVersion"] == "monitoring.coreos.com/v1" and obj["kind"] == "PodMonitor"
        labels = obj["metadata"]["labels"]
        assert labels["app.kubernetes.io/name"] == "ucm-ray" and labels["app.kubernetes.io/instance"] == "ucm-ray"
        assert labels["app.kubernetes.io/managed-by"] == "Helm" and labels["helm.sh/chart"] == "ucm-ray-0.1.0"


def test_the_validators_are_strict():
    """A typo in a pod template and a wrong type in the RayService are caught (not silently passed)."""
    rs = one(render(), "RayService")
    tmpl = pod_templates(rs)["worker"]
    tmpl["spec"]["volumes"][0]["emptyDir"]["sizelimit"] = "1Gi"
    wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "w"}, "template": tmpl}
    with pytest.raises(kubernetes_validate.ValidationError, match="sizelimit"):
        kubernetes_validate.validate(wrapped, K8S_VERSIONS[-1], strict=True)
    rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = "2"
    with pytest.raises(jsonschema.ValidationError, match="'2' is not of type 'integer'"):
        jsonschema.validate(rs, crd_schema("rayservices"))


def test_rayservice_fields_are_where_kuberay_reads_them(rendered):
    name, objects = rendered
    values = group_values(name)
    rs = one(objects, "RayService")
    spec = rs["spec"]
    assert isinstance(spec["serveConfigV2"], str) and "serveConfig" not in spec
    assert rs["metadata"]["name"] == "ucm-ray" and len(rs["metadata"]["name"]) <= 47
    cluster = spec["rayClusterConfig"]
    assert cluster["rayVersion"] == "2.60.0"
    assert cluster["enableInTreeAutoscaling"] is values["head"]["enableInTreeAutoscaling"]
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # no shard, no engine on the head
    (worker,) = cluster["workerGroupSpecs"]
    assert worker["groupName"] == values["worker"]["groupName"]
    for key in ("replicas", "minReplicas", "maxReplicas"):
        assert type(worker[key]) is int and worker[key] == values["worker"][key]
    for group in (head, worker):
        assert all(isinstance(v, str) for v in group["rayStartParams"].values())  # KubeRay: map[string]string
    for group, tmpl in pod_templates(rs).items():
        (container, *_) = tmpl["spec"]["containers"]  # KubeRay runs Ray in the first container
        assert container["name"] == f"ray-{group}"
        assert container["image"] == f"{values['image']['repository']}:{values['image']['tag'] or '0.1.0'}"
        assert {"name": "shared-mem", "mountPath": "/dev/shm"} in container["volumeMounts"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert ports["metrics"] == 8080 and ports["serve"] == 8000
        assert tmpl["metadata"]["labels"]["app.kubernetes.io/component"] == f"ray-{group}"
        assert container["resources"] == values[group]["resources"]
    assert {p["name"]: p["containerPort"] for p in pod_templates(rs)["head"]["spec"]["containers"][0]["ports"]} \
        == {"gcs": 6379, "dashboard": 8265, "client": 10001, "serve": 8000, "metrics": 8080}
    gpus = values["worker"]["resources"]["limits"]["nvidia.com/gpu"]
    assert pod_templates(rs)["worker"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == gpus


def test_shm_is_sized_from_the_tier_the_builder_reads(rendered):
    name, objects = rendered
    values = group_values(name)
    rs = one(objects, "RayService")
    app = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]
    _, tier = PREPARE[app["import_path"]](app["args"])
    cluster = rs["spec"]["rayClusterConfig"]
    for group, tmpl, params in (("worker", pod_templates(rs)["worker"], cluster["workerGroupSpecs"][0]),
                                ("head", pod_templates(rs)["head"], cluster["headGroupSpec"])):
        store = quantity_bytes(str(values[group]["objectStoreMemory"]))
        room = quantity_bytes(str(values[group]["shmHeadroom"]))
        shards = tier.shards_per_node if group == "worker" else 0
        assert shm_bytes(tmpl) == shards * tier.config.pool_bytes + store + room
        assert int(params["rayStartParams"]["object-store-memory"]) == store
        memory = tmpl["spec"]["containers"][0]["resources"]["requests"]["memory"]
        assert shm_bytes(tmpl) <= quantity_bytes(memory)
    expected_pool = {"defaults": 64 << 30, "gpu": 96 << 30, "autoscaling": 32 << 30, "pd": 64 << 30}[name]
    assert tier.config.pool_bytes == expected_pool == app["args"]["tier"]["pool_bytes"]


@pytest.mark.parametrize("spelling", ["64Gi", "64GiB", 68719476736, "0064Gi", "68.719476736G", "0.0625Ti", "65536Mi",
                                      "1.5Gi", "100G", "5000k", "4.096K", "512MiB", "200GB"])
def test_sizes_are_read_as_the_builder_reads_them(spelling):
    """Whatever the spelling, the chart's arithmetic (exact, integers) and ucm_ray.config.parse_size agree."""
    done = template(sets=[f"tier.pool_bytes={spelling}"] if isinstance(spelling, int) else [],
                    set_strings=[] if isinstance(spelling, int) else [f"tier.pool_bytes={spelling}"])
    assert done.returncode == 0, done.stderr
    rs = one([d for d in yaml.safe_load_all(done.stdout) if d], "RayService")
    pool = parse_size(spelling, "pool_bytes")
    assert yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]["args"]["tier"]["pool_bytes"] == pool
    assert shm_bytes(pod_templates(rs)["worker"]) == pool + (8 << 30) + (4 << 30)


@pytest.mark.parametrize("args, error", [
    # the four of the issue
    ({"set_strings": ["worker.replicas=3"]}, "at '/worker/replicas': got string, want integer"),
    ({"sets": ["tier.pool_bytes=-1"]}, "at '/tier/pool_bytes'"),
    ({"set_strings": ["tier.pool_bytes=-5Gi"]}, "'-5Gi' does not match pattern"),
    ({"set_strings": ["tier.pool_bytes=300Gi"]},
     "worker: the shard pools do not fit the pod's memory: /dev/shm needs 312Gi (1 shard(s) x tier.pool_bytes "
     "300Gi + objectStoreMemory 8Gi + shmHeadroom 4Gi) but worker.resources.requests.memory is 256Gi"),
    ({"sets": ["tier.shards_per_node=4"]}, "/dev/shm needs 268Gi (4 shard(s)"),
    ({"sets": ["tier.pool_size=1"]}, "at '/tier': additional properties 'pool_size' not allowed"),
    ({"sets": ["worker.replica=3"]}, "at '/worker': additional properties 'replica' not allowed"),
    ({"sets": ["extra=1"]}, "at '': additional properties 'extra' not allowed"),
    ({"sets": ["model.autoscaling.min=1"]}, "at '/model/autoscaling': additional properties 'min' not allowed"),
    ({"sets": ["monitoring.podMonitor.port=9090"]},
     "at '/monitoring/podMonitor': additional properties 'port' not allowed"),
    # more relations the schema cannot state
    ({"set_strings": ["tier.pool_bytes=1Ki"]}, "tier.pool_bytes: 1Ki is 1024 bytes; expected between 4096"),
    ({"set_strings": ["tier.pool_bytes=0.5"]}, "tier.pool_bytes: \"0.5\" is not a whole number of bytes"),
    ({"set_strings": ["worker.resources.requests.memory=1e9"]}, "'1e9' does not match pattern"),
    ({"sets": ["head.rayStartParams.num-cpus=8"]}, "head: the shard pools do not fit the pod's memory"),
    ({"sets": ["worker.replicas=5"]}, "worker.replicas (5) is outside [worker.minReplicas, worker.maxReplicas]"),
    ({"sets": ["worker.minReplicas=5"]}, "worker.minReplicas (5) is greater than worker.maxReplicas (4)"),
    ({"sets": ["model.tensorParallelSize=16"]}, "model.tensorParallelSize 16 needs 16 GPUs on one worker"),
    ({"sets": ["model.engineKwargs.tensor_parallel_size=4"]}, "set model.tensorParallelSize instead"),
    ({"sets": ["model.autoscaling.minReplicas=9"]}, "model.autoscaling.minReplicas (9) is greater than"),
    ({"sets": ["worker.replicas=1", "model.autoscaling.minReplicas=5"]},
     "model.autoscaling.minReplicas 5 does not fit: 1 worker(s) x 4 replica(s) of 2 GPUs each hold 4"),
    ({"sets": ["serve.mode=pd", "model.prefillAutoscaling.minReplicas=5"]},
     "model.prefillAutoscaling.minReplicas (5) is greater than model.prefillAutoscaling.maxReplicas (4)"),
    ({"sets": ["serve.mode=pd", "worker.replicas=1", "model.autoscaling.minReplicas=3",
               "model.prefillAutoscaling.minReplicas=2"]},
     "model.autoscaling.minReplicas + model.prefillAutoscaling.minReplicas 5 does not fit: 1 worker(s) x 4"),
    ({"set_strings": ["serve.mode=PD"]}, "at '/serve/mode': value must be one of 'openai', 'pd'"),
    ({"sets": ["tier.shard_cpus=9"]}, "worker: 41 CPUs needed"),
    # the app refuses a no-break space in model_id; the chart refuses it before anything starts
    ({"set_strings": ["tier.model_id=llama\u00a08b"]}, "at '/tier/model_id'"),
    ({"sets": ["tier.replication=3"]}, "tier.replication 3 exceeds the 2 shard(s) the app starts with"),
    ({"sets": ["tier.shard_cpus=41"]}, "tier: no pod can host a shard"),
    ({"set_strings": ["worker.rayStartParams.object-store-memory=1000000000"]},
     "set worker.objectStoreMemory instead"),
    ({"sets": ["worker.volumeMounts[0].name=x", "worker.volumeMounts[0].mountPath=/dev/shm/"]},
     "worker.volumeMounts: /dev/shm is mounted by the chart"),
    ({"set_strings": ["model.envVars.VLLM_X=1", "tier.transport=tcp"]}, "at '/tier/transport'"),
    ({"sets": ["diskTier.enabled=true"], "set_strings": ["diskTier.writePolicy=around"]},
     "at '/diskTier/writePolicy': value must be one of 'back', 'through'"),
    ({"sets": ["diskTier.enabled=true"], "set_strings": ["diskTier.hostPath=nvme/ucm"]}, "at '/diskTier/hostPath'"),
    ({"sets": ["diskTier.enabled=true"], "set_strings": ["diskTier.mountPath=/dev/shm/disk"]},
     "at '/diskTier/mountPath'"),
    ({"sets": ["diskTier.enabled=true", "diskTier.tier=1"]}, "additional properties 'tier' not allowed"),
    ({"sets": ["model.envVars.PYTHONHASHSEED=0"]}, "at '/model/envVars/PYTHONHASHSEED': got number, want string"),
])
def test_bad_values_fail_with_a_clear_error(args, error):
    done = template(**args)
    assert done.returncode != 0 and error in done.stderr, done.stderr
    assert done.stdout == ""


def test_scaling_is_a_values_change():
    base = one(render(), "RayService")
    # Worker pods: only the worker group's replicas move; the pod templates and the Serve config
    # stay the same, so KubeRay scales the cluster in place rather than replacing it.
    more = one(render(sets=["worker.replicas=4"]), "RayService")
    assert more["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] == 4
    more["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replicas"] = 2
    assert more == base
    # Engine replicas: only serveConfigV2 moves (KubeRay applies it to the running cluster).
    wider = one(render(sets=["model.autoscaling.maxReplicas=16", "worker.replicas=4"]), "RayService")
    auto = yaml.safe_load(wider["spec"]["serveConfigV2"])["applications"][0]["args"]["llm_configs"][0]
    assert auto["deployment_config"]["autoscaling_config"] == {"min_replicas": 2, "max_replicas": 16,
                                                               "target_ongoing_requests": 16}
    assert wider["spec"]["rayClusterConfig"]["headGroupSpec"] == base["spec"]["rayClusterConfig"]["headGroupSpec"]
    # The Ray autoscaler: KubeRay moves worker pods between the bounds.
    cluster = one(render(*VALUES["autoscaling"]), "RayService")["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["autoscalerOptions"] == {"upscalingMode": "Default", "idleTimeoutSeconds": 600}
    assert {k: cluster["workerGroupSpecs"][0][k] for k in ("replicas", "minReplicas", "maxReplicas")} == \
        {"replicas": 1, "minReplicas": 1, "maxReplicas": 6}


def test_defaults_mirror_the_gpu_example():
    """The chart's default app is deploy/serve/gpu-example.yaml's, as the builder sees both."""
    rs = one(render(), "RayService")
    ours = yaml.safe_load(rs["spec"]["serveConfigV2"])
    example = yaml.safe_load((ROOT / "deploy/serve/gpu-example.yaml").read_text())
    assert prepare_app(ours["applications"][0]["args"]) == prepare_app(example["applications"][0]["args"])
    assert (ours["proxy_location"], ours["http_options"]) == (example["proxy_location"], example["http_options"])


def test_pd_mode_renders_the_pd_builders_app_from_the_same_model():
    """serve.mode pd: build_pd_app with a prefill and a decode config that differ only in their
    scaling (one store namespace, or the decode never finds the prefill's blocks), as the builder
    reads them; the GPU PD example's engine layout."""
    values = group_values("pd")
    app = yaml.safe_load(one(render(*VALUES["pd"]), "RayService")["spec"]["serveConfigV2"])["applications"][0]
    assert app["import_path"] == PD_BUILDER and "llm_configs" not in app["args"]
    serving, tier = prepare_pd_app(app["args"])
    prefill, decode = serving["prefill_config"], serving["decode_config"]
    for role, scaling in ((prefill, values["model"]["prefillAutoscaling"]), (decode, values["model"]["autoscaling"])):
        assert role["engine_kwargs"]["kv_transfer_config"]["kv_connector"] == "UcmRayConnector"
        assert role["engine_kwargs"]["kv_transfer_config"]["kv_role"] == "kv_both"
        assert role["deployment_config"]["autoscaling_config"] == {
            "min_replicas": scaling["minReplicas"], "max_replicas": scaling["maxReplicas"],
            "target_ongoing_requests": scaling["targetOngoingRequests"]}
    assert {k: v for k, v in prefill.items() if k != "deployment_config"} == \
        {k: v for k, v in decode.items() if k != "deployment_config"}
    example = yaml.safe_load((ROOT / "deploy/serve/gpu-pd-example.yaml").read_text())["applications"][0]["args"]
    example_serving, _ = prepare_pd_app(example)
    assert prefill["engine_kwargs"]["tensor_parallel_size"] == \
        example_serving["prefill_config"]["engine_kwargs"]["tensor_parallel_size"]
    assert tier.shards_per_node == values["tier"]["shards_per_node"]


def test_monitoring_is_off_by_default_and_renders_when_on():
    objects = render(*VALUES["gpu"])
    monitor = one(objects, "PodMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "metrics" and endpoint["path"] == "/metrics"
    selector = monitor["spec"]["selector"]["matchLabels"]
    for tmpl in pod_templates(one(objects, "RayService")).values():  # it selects every Ray pod
        assert selector.items() <= tmpl["metadata"]["labels"].items()
        assert {"name": "metrics", "containerPort": 8080, "protocol": "TCP"} in tmpl["spec"]["containers"][0]["ports"]
    dashboard = one(objects, "ConfigMap")
    assert dashboard["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert dashboard["metadata"]["annotations"] == {"grafana_folder": "LLM"}
    chart_copy = (CHART / "dashboards" / "ucm-ray.json").read_text()
    assert dashboard["data"]["ucm-ray.json"] == chart_copy.rstrip("\n")
    assert json.loads(dashboard["data"]["ucm-ray.json"])["title"]


def test_chart_dashboard_is_the_deploy_one():
    source = ROOT / "deploy" / "grafana" / "ucm-ray.json"
    assert (CHART / "dashboards" / "ucm-ray.json").read_bytes() == source.read_bytes(), \
        "the chart's copy is stale: cp deploy/grafana/ucm-ray.json helm/ucm-ray/dashboards/ucm-ray.json"


def test_notes_say_where_things_are():
    done = helm("install", "ucm-ray", str(CHART), "--dry-run=client", "--namespace", "llm")
    assert done.returncode == 0, done.stderr
    notes = done.stdout.split("NOTES:", 1)[1]
    for text in ("port-forward svc/ucm-ray-serve-svc 8000:8000", "/v1/models", "port-forward svc/ucm-ray-head-svc 8265",
                 "deploy/grafana/ucm-ray.json", "1 shard(s) x 64Gi per worker in /dev/shm (sized 76Gi)",
                 "--set worker.replicas=N"):
        assert text in notes, notes


def test_every_tier_setting_of_the_readme_is_accepted_by_the_chart():
    """values.yaml says the tier takes any key of README "Configuration" but those the chart
    decides itself; its schema refused ``local_lookups`` and ``model_id`` (found when a key was
    added)."""
    from ucm_ray.config import UcmRayConfig

    schema = json.loads((CHART / "values.schema.json").read_text())
    tier = schema["properties"]["tier"]["properties"]
    # The disk tier's keys come from diskTier (the chart mounts the volume disk_dir names).
    decided = {"num_shards", "ray_address", "shm_dir", "disk_dir", "disk_bytes", "disk_write_policy", "disk_io",
               "disk_wait_s", "disk_recompute_bytes_s"}
    assert set(tier) == (set(UcmRayConfig.keys()) - decided) | {"shards_per_node"}
    settings = ["tier.local_lookups=false", "tier.load_at_once_ratio=0", "tier.model_id=llama"]
    app = one(render(sets=settings), "RayService")["spec"]["serveConfigV2"]
    assert "local_lookups: false" in app and "load_at_once_ratio: 0" in app and "model_id: llama" in app


def test_the_disk_tier_mounts_a_volume_where_disk_dir_points():
    """Off by default; on, the pods that host shards mount the volume at diskTier.mountPath and the
    app's tier names it as disk_dir (hostPath: a node directory; storageClassName: a claim per pod
    sized for its shards); a head without shards gets an empty directory there (Serve may build
    the app on it, and the config wants disk_dir to exist). Valid for KubeRay and Kubernetes."""
    def tier_of(rs: dict) -> dict:
        return yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]["args"]["tier"]

    def disk_volume(tmpl: dict) -> dict | None:
        mounts = [m for m in tmpl["spec"]["containers"][0]["volumeMounts"] if m["name"] == "ucm-ray-disk"]
        volumes = [v for v in tmpl["spec"]["volumes"] if v["name"] == "ucm-ray-disk"]
        assert len(mounts) == len(volumes) <= 1
        return {**volumes[0], "mountPath": mounts[0]["mountPath"]} if volumes else None

    def valid(rs: dict) -> dict:
        jsonschema.validate(rs, crd_schema("rayservices"))
        for group, tmpl in pod_templates(rs).items():
            wrapped = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": group}, "template": tmpl}
            for version in K8S_VERSIONS:
                kubernetes_validate.validate(wrapped, version, strict=True)
        return rs

    off = one(render(), "RayService")
    assert not any(k.startswith("disk_") for k in tier_of(off))
    assert all(disk_volume(t) is None for t in pod_templates(off).values())
    on = ["diskTier.enabled=true", "diskTier.bytes=1Ti", "tier.shards_per_node=2", "worker.shmHeadroom=1Gi"]
    host = valid(one(render(sets=[*on, "diskTier.recomputeBytesS=1300000000"],
                            set_strings=["diskTier.hostPath=/mnt/nvme0/ucm", "diskTier.writePolicy=through"]),
                     "RayService"))
    assert {k: v for k, v in tier_of(host).items() if k.startswith("disk_")} == {
        "disk_dir": "/var/lib/ucm-ray/disk", "disk_bytes": 1 << 40, "disk_write_policy": "through", "disk_wait_s": 2.0,
        "disk_recompute_bytes_s": 1300000000}
    templates = pod_templates(host)
    assert disk_volume(templates["head"]) == {"name": "ucm-ray-disk", "mountPath": "/var/lib/ucm-ray/disk",
                                              "emptyDir": {}}  # num-cpus 0: no shard there
    assert disk_volume(templates["worker"]) == {"name": "ucm-ray-disk", "mountPath": "/var/lib/ucm-ray/disk",
                                                "hostPath": {"path": "/mnt/nvme0/ucm", "type": "DirectoryOrCreate"}}
    claim = valid(one(render(sets=on, set_strings=["diskTier.storageClassName=local-nvme"]), "RayService"))
    volume = disk_volume(pod_templates(claim)["worker"])
    assert volume is not None
    spec = volume["ephemeral"]["volumeClaimTemplate"]["spec"]
    assert spec["storageClassName"] == "local-nvme"
    assert quantity_bytes(spec["resources"]["requests"]["storage"]) == 2 << 40  # 1 TiB x 2 shards
