"""The dashboard's boot card: /api/boots lists the last boots `up` recorded in the history folder
(results/boot_history.jsonl), and the page has the card that shows them."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient
from test_dashboard_api import LOCAL, Engine, settings_for

from vllmstack.core.paths import Project
from vllmstack.dashboard.app import BOOTS_SHOWN, create_app
from vllmstack.serve.boot_history import BootRecord, append_boot
from vllmstack.serve.boot_phases import measure_boot

DATA = Path(__file__).parent / "data"


def test_the_last_boots_are_listed_newest_last(tmp_path: Path) -> None:
    project = Project(tmp_path)  # `up` writes into results/, the dashboard's history folder
    app = create_app(settings_for(tmp_path, history_dir=project.results), fetch_text=Engine().fetch,
                     poll=False)
    with TestClient(app, base_url=LOCAL) as client:
        assert client.get("/api/boots").json() == {"skipped": 0, "boots": []}
        cold = measure_boot((DATA / "boot-cpu-cold.log").read_text().splitlines())
        for n in range(BOOTS_SHOWN + 1):
            append_boot(project, BootRecord(1000.0 + n, f"p{n}", "", cold))
        with (project.results / "boot_history.jsonl").open("a") as handle:
            handle.write("{torn")  # a writer killed mid-line: counted, never fatal
        data = client.get("/api/boots").json()
        assert data["skipped"] == 1
        assert [b["profile"] for b in data["boots"]] == [f"p{n}" for n in range(2, BOOTS_SHOWN + 1)]
        last = data["boots"][-1]
        assert (last["compile"], last["wall_s"], last["recorded"]) == ("cold", 61.0, 1005.0)
        assert [p["seconds"] for p in last["phases"] if p["name"] == "compiling"] == [22.0]
        page = client.get("/").text
        assert 'id="card-boots"' in page and 'id="boots-rows"' in page
        assert "pollBoots();" in client.get("/app.js").text
