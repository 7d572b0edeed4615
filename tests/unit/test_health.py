"""The health report's rules (node/health.py) on the reports they read; an expiring API certificate is a
warning. The report of a serving node, through `vsan health`: tests/integration/test_health_cli.py."""

from __future__ import annotations

import datetime
from pathlib import Path

from openvsan.node.health import (
    certificate_findings,
    pool_findings,
    replication_findings,
    volume_findings,
    worker_findings,
)


def test_each_rule_reads_its_report() -> None:
    assert pool_findings([{"name": "p", "state": "failed", "level": 5}])[0]["severity"] == "critical"
    assert pool_findings([{"name": "p", "state": "degraded", "level": 6}])[0]["severity"] == "warning"
    rebuilding = pool_findings([{"name": "p", "state": "rebuilding", "level": 1, "rebuild_progress": 42.5}])
    assert rebuilding[0]["severity"] == "warning" and "42.5 %" in rebuilding[0]["what"]
    assert pool_findings([{"name": "p", "state": "optimal", "level": 1, "resync_progress": 10.0}])[0]["severity"] \
        == "info"
    group = {"capacity": 100, "used": 96, "soft_threshold": 80, "overcommit": 2.0, "metadata_used": 0.9}
    found = volume_findings([{"name": "a", "device": "d", "volume_group": group},
                             {"name": "b", "device": "d", "volume_group": group}])
    assert [f["severity"] for f in found] == ["critical", "warning"]      # once per group, not per volume
    assert "96 % full" in found[0]["what"] and "metadata" in found[1]["what"]
    found = volume_findings([{"name": "a", "pool": "p", "volume_group": {**group, "used": 85, "metadata_used": 0}}])
    assert [f["severity"] for f in found] == ["warning"] and "soft threshold 80 %" in found[0]["what"]
    st = {"replicated": True, "role": "primary", "primary": "n1", "out_of_sync": {"n2": 7},
          "peers": {"n2": {"connected": False, "dirty_regions": 3, "resyncing": False}}, "mirror": {"fenced": False}}
    found = replication_findings("v", st)
    assert len(found) == 1 and "n2 is out of sync since epoch 7 (not connected, 3 regions" in found[0]["what"]
    assert replication_findings("v", {**st, "out_of_sync": {}, "mirror": {"fenced": True}})[0]["severity"] == \
        "critical"
    workers = [{"worker": 0, "serving": True, "restarts": 0}, {"worker": 1, "serving": False, "volumes": ["v"]},
               {"worker": 2, "serving": True, "restarts": 2, "last_exit": "killed by SIGKILL"}]
    assert [f["severity"] for f in worker_findings(workers)] == ["critical", "warning"]


def test_an_api_certificate_close_to_its_end_is_a_warning(tmp_path: Path) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "node")])
    now = datetime.datetime(2026, 12, 1, tzinfo=datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=40))
            .sign(key, hashes.SHA256()))
    path = tmp_path / "api-cert.pem"
    path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    assert certificate_findings(path, now) == []
    soon = certificate_findings(path, now + datetime.timedelta(days=20))
    assert soon[0]["severity"] == "warning" and "expires in 20 days" in soon[0]["what"]
    assert certificate_findings(path, now + datetime.timedelta(days=41))[0]["severity"] == "critical"
    assert certificate_findings(None) == []
