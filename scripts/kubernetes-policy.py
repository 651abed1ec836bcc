#!/usr/bin/env python3
"""The house rules of deploy/kubernetes/ that a schema cannot state (docs/operations.md,
"Kubernetes"), checked after the schema validation of scripts/kubernetes-check.sh:

- every Deployment sets terminationGracePeriodSeconds, runs as non-root with a read-only root
  filesystem, no privilege escalation and every capability dropped;
- every container has liveness and readiness probes on the paths its service answers
  (the projector /livez and /readyz on its metrics listener, the gateway /livez or /healthz
  and /readyz on its main listener), CPU and memory requests and a memory limit;
- secrets reach the processes as files: no environment variable from a Secret, every Secret
  volume mounted read-only, every *_FILE variable naming a file under a mounted volume;
- the gateway's terminationGracePeriodSeconds is above its preStop pause plus
  gateway.shutdown_grace_ms of the configuration file the ConfigMap holds.

Usage: kubernetes-policy.py FILE...  (exit 1 naming each broken rule). With --self-test,
breaks each rule in a copy of the manifests and fails unless every break is caught.
"""

import copy
import sys
import tomllib

import yaml

PROBES = {
    "parsley-projector": {"liveness": {"/livez"}, "readiness": {"/readyz"}, "port": "metrics"},
    "parsley-gateway": {"liveness": {"/livez", "/healthz"}, "readiness": {"/readyz"}, "port": "http"},
}


def load(paths):
    docs = []
    for path in paths:
        with open(path, encoding="utf-8") as f:
            docs.extend((path, d) for d in yaml.safe_load_all(f) if d)
    return docs


def config_of(docs):
    """The parsley.toml of the ConfigMap parsley-config, parsed."""
    for _, d in docs:
        if d.get("kind") == "ConfigMap" and d["metadata"]["name"] == "parsley-config":
            return tomllib.loads(d["data"]["parsley.toml"])
    return None


def prestop_ms(container):
    command = (container.get("lifecycle", {}).get("preStop", {}).get("exec", {}) or {}).get("command") or []
    if len(command) == 2 and command[0] == "sleep":
        return int(float(command[1]) * 1000)
    sleep = container.get("lifecycle", {}).get("preStop", {}).get("sleep")
    return int(sleep["seconds"]) * 1000 if sleep else 0


def check(docs):
    errors = []
    config = config_of(docs)
    if config is None:
        errors.append("no ConfigMap parsley-config with a parsley.toml")
    deployments = {d["metadata"]["name"]: (p, d) for p, d in docs if d.get("kind") == "Deployment"}
    for name in PROBES:
        if name not in deployments:
            errors.append(f"no Deployment {name}")
    for name, (path, d) in sorted(deployments.items()):
        where = f"{path}: Deployment {name}"
        pod = d["spec"]["template"]["spec"]
        grace = pod.get("terminationGracePeriodSeconds")
        if grace is None:
            errors.append(f"{where}: terminationGracePeriodSeconds is not set")
        pod_sc = pod.get("securityContext", {})
        mounts_by_volume = {}
        for c in pod.get("containers", []):
            for m in c.get("volumeMounts", []):
                mounts_by_volume.setdefault(m["name"], []).append(m)
        for v in pod.get("volumes", []):
            if "secret" in v:
                for m in mounts_by_volume.get(v["name"], []):
                    if not m.get("readOnly"):
                        errors.append(f"{where}: Secret volume {v['name']} mounted writable")
        for c in pod.get("containers", []):
            cw = f"{where}, container {c['name']}"
            sc = c.get("securityContext", {})
            if not (sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) is True):
                errors.append(f"{cw}: runAsNonRoot is not true")
            if sc.get("runAsUser", pod_sc.get("runAsUser")) == 0:
                errors.append(f"{cw}: runs as uid 0")
            if sc.get("readOnlyRootFilesystem") is not True:
                errors.append(f"{cw}: readOnlyRootFilesystem is not true")
            if sc.get("allowPrivilegeEscalation") is not False:
                errors.append(f"{cw}: allowPrivilegeEscalation is not false")
            if "ALL" not in sc.get("capabilities", {}).get("drop", []):
                errors.append(f"{cw}: capabilities are not all dropped")
            res = c.get("resources", {})
            for kind in ("cpu", "memory"):
                if kind not in res.get("requests", {}):
                    errors.append(f"{cw}: no {kind} request")
            if "memory" not in res.get("limits", {}):
                errors.append(f"{cw}: no memory limit")
            for e in c.get("env", []):
                if "secretKeyRef" in (e.get("valueFrom") or {}):
                    errors.append(f"{cw}: {e['name']} comes from a Secret: secrets are files")
                if e["name"].endswith("_FILE"):
                    value = e.get("value", "")
                    if not any(value.startswith(m["mountPath"].rstrip("/") + "/") for m in c.get("volumeMounts", [])):
                        errors.append(f"{cw}: {e['name']} names {value!r}, under no mounted volume")
            for e in c.get("envFrom", []):
                if "secretRef" in e:
                    errors.append(f"{cw}: envFrom a Secret: secrets are files")
            expected = PROBES.get(name)
            ports = {p.get("name") for p in c.get("ports", [])}
            for probe in ("liveness", "readiness"):
                p = c.get(f"{probe}Probe")
                if p is None:
                    errors.append(f"{cw}: no {probe} probe")
                    continue
                if expected is None:
                    continue
                get = p.get("httpGet", {})
                if get.get("path") not in expected[probe]:
                    errors.append(f"{cw}: {probe} probe on {get.get('path')!r}, not {sorted(expected[probe])}")
                if get.get("port") != expected["port"] or expected["port"] not in ports:
                    errors.append(f"{cw}: {probe} probe not on the {expected['port']} port")
            if name == "parsley-gateway" and config is not None and grace is not None:
                drain = config.get("gateway", {}).get("shutdown_grace_ms")
                if drain is None:
                    errors.append(f"{where}: the configuration sets no gateway.shutdown_grace_ms")
                elif grace * 1000 <= drain + prestop_ms(c):
                    errors.append(
                        f"{where}: terminationGracePeriodSeconds {grace} s is not above the preStop pause "
                        f"({prestop_ms(c)} ms) plus gateway.shutdown_grace_ms ({drain} ms)"
                    )
    return errors


def self_test(docs):
    """Each rule broken once in a copy: every break must be reported."""

    def deployment(ds, name):
        return next(d for _, d in ds if d.get("kind") == "Deployment" and d["metadata"]["name"] == name)

    def container(ds, name):
        return deployment(ds, name)["spec"]["template"]["spec"]["containers"][0]

    def config_edit(ds, text):
        cm = next(d for _, d in ds if d.get("kind") == "ConfigMap")
        cm["data"]["parsley.toml"] = cm["data"]["parsley.toml"].replace("shutdown_grace_ms = 20000", text)

    breaks = {
        "no grace period": lambda ds: deployment(ds, "parsley-projector")["spec"]["template"]["spec"].pop(
            "terminationGracePeriodSeconds"
        ),
        "writable root": lambda ds: container(ds, "parsley-gateway")["securityContext"].update(
            readOnlyRootFilesystem=False
        ),
        "root user": lambda ds: deployment(ds, "parsley-gateway")["spec"]["template"]["spec"]["securityContext"].update(
            runAsNonRoot=False
        ),
        "no memory limit": lambda ds: container(ds, "parsley-projector")["resources"].pop("limits"),
        "secret in env": lambda ds: container(ds, "parsley-gateway")["env"].append(
            {"name": "PARSLEY_TOKEN_KEYS", "valueFrom": {"secretKeyRef": {"name": "parsley-gateway", "key": "k"}}}
        ),
        "no readiness probe": lambda ds: container(ds, "parsley-projector").pop("readinessProbe"),
        "wrong probe path": lambda ds: container(ds, "parsley-projector")["livenessProbe"]["httpGet"].update(
            path="/healthz"
        ),
        "grace below the drain": lambda ds: config_edit(ds, "shutdown_grace_ms = 28000"),
        "no drain configured": lambda ds: config_edit(ds, ""),
    }
    missed = []
    for what, breaking in breaks.items():
        broken = copy.deepcopy(docs)
        breaking(broken)
        if not check(broken):
            missed.append(what)
    if missed:
        print("kubernetes-policy self-test: breaks not caught: " + ", ".join(missed), file=sys.stderr)
        return 1
    print(f"kubernetes-policy self-test: {len(breaks)} breaks caught")
    return 0


def main(argv):
    test = "--self-test" in argv
    paths = [a for a in argv if a != "--self-test"]
    if not paths:
        print(__doc__, file=sys.stderr)
        return 2
    docs = load(paths)
    errors = check(docs)
    for e in errors:
        print(f"kubernetes-policy: {e}", file=sys.stderr)
    if errors:
        return 1
    print(f"kubernetes-policy: {len(docs)} resources in {len(paths)} files follow the rules")
    return self_test(docs) if test else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
