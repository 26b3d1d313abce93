"""Render a kustomization with the few features deploy/kubernetes uses, without kustomize.

Users render the overlays with ``kubectl kustomize`` (kustomize built into kubectl); a test
machine may have neither, so tests/test_kubernetes.py renders with this, and compares the two
where kubectl is installed. It knows: ``resources`` (files and folders), ``namespace``,
``images``, ``secretGenerator`` from files without a name hash, and ``patches`` that are JSON
patches (RFC 6902: add, remove, replace, test) aimed by kind and name (a regular expression, as
kustomize reads it). Anything else in a kustomization is refused by name, so the manifests
cannot come to lean on a feature rendered here differently from kustomize.
"""

from __future__ import annotations

import base64
import copy
import re
from pathlib import Path
from typing import Any

import yaml

_KNOWN = {"apiVersion", "kind", "namespace", "resources", "images", "patches", "secretGenerator"}
# The kinds that live outside namespaces, among those a kustomization here may hold.
_CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition"}


def render(folder: Path) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize folder`` prints, in the order resources are listed."""
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(spec) - _KNOWN
    if unknown:
        raise ValueError(f"{folder}: kustomization fields not supported here: {sorted(unknown)}")
    objects: list[dict[str, Any]] = []
    for entry in spec.get("resources", []):
        path = folder / entry
        if path.is_dir():
            objects += render(path)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    objects += [_secret(folder, generator) for generator in spec.get("secretGenerator", [])]
    if "namespace" in spec:
        for obj in objects:
            if obj["kind"] not in _CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = spec["namespace"]
    for patch in spec.get("patches", []):
        _patch(folder, objects, patch)
    for image in spec.get("images", []):
        _set_image(objects, image)
    return objects


def _secret(folder: Path, generator: dict[str, Any]) -> dict[str, Any]:
    if set(generator) - {"name", "files", "options"} or not generator.get("files"):
        raise ValueError(f"secretGenerator: only name, files and options here, not {generator}")
    if generator.get("options") != {"disableNameSuffixHash": True}:
        raise ValueError("secretGenerator: a name hash is kustomize's own; disable it")
    data = {}
    for item in generator["files"]:
        key, _, name = item.rpartition("=")
        data[key or Path(name).name] = base64.b64encode((folder / name).read_bytes()).decode()
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": generator["name"]},
        "type": "Opaque",
        "data": data,
    }


def _patch(folder: Path, objects: list[dict[str, Any]], patch: dict[str, Any]) -> None:
    target = patch.get("target", {})
    if set(patch) != {"path", "target"} or set(target) - {"kind", "name"}:
        raise ValueError(f"patches: only a file aimed by kind and name here, not {patch}")
    operations = yaml.safe_load((folder / patch["path"]).read_text())
    if not isinstance(operations, list):
        raise ValueError(f"{patch['path']}: only JSON patches (a list of operations) here")
    matched = [
        obj
        for obj in objects
        if obj["kind"] == target.get("kind", obj["kind"])
        and re.fullmatch(target.get("name", ".*"), obj["metadata"]["name"])
    ]
    if not matched:
        raise ValueError(f"patch {patch['path']}: no object matches {target}")
    for obj in matched:
        for operation in operations:
            _apply(obj, operation)


def _apply(obj: dict[str, Any], operation: dict[str, Any]) -> None:
    op, pointer = operation["op"], operation["path"]
    *parents, last = [part.replace("~1", "/").replace("~0", "~") for part in pointer.split("/")[1:]]
    node: Any = obj
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    value = copy.deepcopy(operation.get("value"))
    if isinstance(node, list):
        index = len(node) if last == "-" else int(last)
        if op == "add":
            node.insert(index, value)
            return
        if not 0 <= index < len(node):
            raise ValueError(f"{pointer}: no such item")
    elif op != "add" and last not in node:
        raise ValueError(f"{pointer}: no such field")
    else:
        index = last  # type: ignore[assignment]
    if op in ("add", "replace"):
        node[index] = value
    elif op == "remove":
        del node[index]
    elif op == "test":
        if node[index] != value:
            raise ValueError(f"test failed at {pointer}: {node[index]!r} is not {value!r}")
    else:
        raise ValueError(f"JSON patch operation {op!r} is not supported here")


def _set_image(objects: list[dict[str, Any]], image: dict[str, Any]) -> None:
    if set(image) - {"name", "newName", "newTag"}:
        raise ValueError(f"images: only name, newName and newTag here, not {image}")
    for obj in objects:
        pod = obj.get("spec", {}).get("template", {}).get("spec", {})
        for container in pod.get("containers", []) + pod.get("initContainers", []):
            name, _, tag = container["image"].partition(":")
            if name == image["name"]:
                name = image.get("newName", name)
                tag = image.get("newTag", tag)
                container["image"] = f"{name}:{tag}" if tag else name
