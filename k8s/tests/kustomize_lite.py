"""A minimal `kustomize build` for the kustomizations under k8s/, used when neither the
`kustomize` binary nor a `kubectl` with kustomize v4+ is installed.

It implements only what k8s/ uses, and refuses anything else, so that it cannot silently
build something different from the real tool:

- `resources`: YAML files and directories holding a kustomization.yaml (recursively);
- `images`: `name` with `newName`, `newTag` and/or `digest`, applied to the `image` of
  containers and initContainers of pod templates;
- `patches` with `path`: strategic merge patches whose target is the patch's own
  apiVersion/kind/metadata.name. Maps merge recursively; lists merge by the Kubernetes merge
  key where the API defines one (containers, initContainers, env, volumes, ports,
  imagePullSecrets by `name`/`containerPort`, volumeMounts by `mountPath`) and are replaced
  otherwise (tolerations, args, command, ...); `null` deletes a key. Merged list items take
  the patch's order, followed by the original items the patch does not name: the order
  kustomize v5 produces.

When the real tool is present the tests build with both and compare the results, which
keeps this file honest.
"""

from __future__ import annotations

import copy
import os
from typing import Any

import yaml

SUPPORTED_KEYS = {"apiVersion", "kind", "resources", "images", "patches"}

# Lists merged by key in a strategic merge patch: (field name, merge key). These are the
# patchMergeKey annotations of the Kubernetes API for the fields k8s/ patches.
MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "env": "name",
    "volumes": "name",
    "imagePullSecrets": "name",
    "volumeMounts": "mountPath",
    "ports": "containerPort",
    "volumeDevices": "devicePath",
}


class KustomizeError(Exception):
    pass


def _load_docs(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d]


def _identity(doc: dict) -> tuple[str, str, str]:
    return (doc.get("apiVersion", ""), doc.get("kind", ""), doc.get("metadata", {}).get("name", ""))


def merge_patch(original: Any, patch: Any, field: str | None = None) -> Any:
    """Strategic merge of `patch` into `original` (both plain YAML data)."""
    if isinstance(patch, dict) and isinstance(original, dict):
        if any(k.startswith("$") for k in patch):
            raise KustomizeError(f"patch directives are not supported: {sorted(patch)}")
        out = copy.deepcopy(original)
        for key, value in patch.items():
            if value is None:
                out.pop(key, None)
            elif key in out:
                out[key] = merge_patch(out[key], value, key)
            else:
                out[key] = copy.deepcopy(value)
        return out
    if isinstance(patch, list) and isinstance(original, list) and field in MERGE_KEYS:
        key = MERGE_KEYS[field]
        by_key = {}
        for item in original:
            if not isinstance(item, dict) or key not in item:
                raise KustomizeError(f"{field}: an item without its merge key {key}")
            by_key[item[key]] = item
        merged, named = [], set()
        for item in patch:
            if not isinstance(item, dict) or key not in item:
                raise KustomizeError(f"{field}: a patch item without its merge key {key}")
            named.add(item[key])
            if item[key] in by_key:
                merged.append(merge_patch(by_key[item[key]], item, None))
            else:
                merged.append(copy.deepcopy(item))
        merged += [copy.deepcopy(i) for i in original if i[key] not in named]
        return merged
    return copy.deepcopy(patch)


def _apply_images(doc: dict, images: list[dict]) -> None:
    spec = doc.get("spec", {})
    pod = spec.get("template", {}).get("spec") if "template" in spec else None
    if pod is None:
        return
    for field in ("containers", "initContainers"):
        for container in pod.get(field, []) or []:
            image = container.get("image", "")
            name, tag, digest = image, None, None
            if "@" in name:
                name, digest = name.split("@", 1)
            elif ":" in name.rsplit("/", 1)[-1]:
                name, tag = name.rsplit(":", 1)
            for rule in images:
                unknown = set(rule) - {"name", "newName", "newTag", "digest"}
                if unknown:
                    raise KustomizeError(f"images: unsupported fields {sorted(unknown)}")
                if rule["name"] != name:
                    continue
                new_name = rule.get("newName", name)
                if "digest" in rule:
                    container["image"] = f"{new_name}@{rule['digest']}"
                elif "newTag" in rule:
                    container["image"] = f"{new_name}:{rule['newTag']}"
                elif digest:
                    container["image"] = f"{new_name}@{digest}"
                elif tag:
                    container["image"] = f"{new_name}:{tag}"
                else:
                    container["image"] = new_name


def build(directory: str) -> list[dict]:
    """The resources the kustomization in `directory` produces."""
    path = os.path.join(directory, "kustomization.yaml")
    with open(path, encoding="utf-8") as f:
        kust = yaml.safe_load(f)
    unknown = set(kust) - SUPPORTED_KEYS
    if unknown:
        raise KustomizeError(f"{path}: unsupported fields {sorted(unknown)}")
    docs: list[dict] = []
    for resource in kust.get("resources", []):
        target = os.path.normpath(os.path.join(directory, resource))
        if os.path.isdir(target):
            docs += build(target)
        elif os.path.isfile(target):
            docs += _load_docs(target)
        else:
            raise KustomizeError(f"{path}: resource {resource} not found")
    seen = set()
    for doc in docs:
        ident = _identity(doc)
        if ident in seen:
            raise KustomizeError(f"{path}: {ident} appears twice")
        seen.add(ident)
    for patch_entry in kust.get("patches", []):
        if set(patch_entry) != {"path"}:
            raise KustomizeError(f"{path}: only `patches: - path: FILE` is supported")
        for patch in _load_docs(os.path.join(directory, patch_entry["path"])):
            ident = _identity(patch)
            matches = [i for i, d in enumerate(docs) if _identity(d) == ident]
            if len(matches) != 1:
                raise KustomizeError(f"{path}: patch target {ident} matches {len(matches)} resources")
            docs[matches[0]] = merge_patch(docs[matches[0]], patch)
    if kust.get("images"):
        for doc in docs:
            _apply_images(doc, kust["images"])
    return docs
