"""The documentation holds together: the configuration reference is the schema's, every setting the
pages name exists, every relative link lands on a file (and a heading, when it names one), the README
stays short, and the metrics table lists every metric meshtrain exports."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path


from meshtrain.cli.config_reference import REFERENCE, render, setting_keys

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
README_LIMIT = 12_500  # bytes: the README is the short way in; the rest lives under docs/

LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^[ \t]*(```|~~~).*?^[ \t]*\1", re.MULTILINE | re.DOTALL)
CODE_SPAN = re.compile(r"`[^`\n]*`")


def pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def links(page: Path) -> list[str]:
    """Link targets in a page's text (not in code blocks or code spans)."""
    text = CODE_SPAN.sub("", FENCE.sub("", page.read_text(encoding="utf-8")))
    return LINK.findall(text)


def anchors(page: Path) -> set[str]:
    """GitHub's heading anchors of a markdown page: lower case, punctuation dropped, spaces to hyphens,
    a repeated one numbered."""
    seen: dict[str, int] = {}
    found = set()
    for line in FENCE.sub("", page.read_text(encoding="utf-8")).splitlines():
        heading = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not heading:
            continue
        slug = re.sub(r"[^\w\- ]", "", heading[1].lower()).replace(" ", "-")
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        found.add(slug if count == 0 else f"{slug}-{count}")
    return found


def test_the_configuration_reference_is_the_schemas() -> None:
    assert REFERENCE == DOCS / "configuration.md"
    assert REFERENCE.is_file(), "docs/configuration.md is missing: python jobs/config_reference.py --write"
    assert REFERENCE.read_text(encoding="utf-8") == render(), (
        "docs/configuration.md is stale: python jobs/config_reference.py --write"
    )


def test_the_record_reference_is_the_record_types() -> None:
    from meshtrain.cli.record_reference import REFERENCE as RECORDS, render as render_records

    assert RECORDS == DOCS / "records.md"
    assert RECORDS.read_text(encoding="utf-8") == render_records(), (
        "docs/records.md is stale: python jobs/record_reference.py --write"
    )


def test_the_reference_check_fails_on_a_stale_page(tmp_path: Path) -> None:
    stale = tmp_path / "configuration.md"
    stale.write_text(render().replace("| `train.steps` |", "| `train.stepz` |"), encoding="utf-8")
    command = [sys.executable, str(REPO / "jobs" / "config_reference.py"), "--check", "--path"]
    result = subprocess.run([*command, str(stale)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and result.stderr.count("\n") == 1 and "--write" in result.stderr, result
    stale.write_text(render(), encoding="utf-8")
    assert subprocess.run([*command, str(stale)], capture_output=True, timeout=120).returncode == 0


def test_every_setting_the_pages_name_exists() -> None:
    """A dotted setting in code (`run.hang_timeout_s`, `train.steps=500`) that the schema lacks is a
    page that a rename or a move left behind; file names such as `metrics.jsonl` are not settings."""
    keys = setting_keys()
    sections = {key for key in keys if "." not in key}
    unknown = []
    for page in pages():
        if page == REFERENCE:
            continue
        for code in CODE_SPAN.findall(page.read_text(encoding="utf-8")):
            for name in re.findall(r"(?<![\w./-])([a-z_0-9]+(?:\.[a-z_0-9]+)+)", code.strip("`")):
                if name.split(".")[0] not in sections or re.search(r"\.(jsonl?|yaml|py|md|safetensors)$", name):
                    continue
                if name not in keys:
                    unknown.append(f"{page.relative_to(REPO)}: {name}")
    assert not unknown, "settings the schema does not have:\n" + "\n".join(unknown)


def test_every_relative_link_points_at_an_existing_file() -> None:
    broken = []
    for page in pages():
        for target in links(page):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...
                continue
            path, _, anchor = target.partition("#")
            destination = (page.parent / path).resolve() if path else page
            if not destination.exists():
                broken.append(f"{page.relative_to(REPO)}: {target} (no such file)")
            elif anchor and destination.suffix == ".md" and anchor not in anchors(destination):
                broken.append(f"{page.relative_to(REPO)}: {target} (no such heading)")
    assert not broken, "\n".join(broken)


def test_the_behaviour_map_lists_every_test_as_it_reads_now() -> None:
    import behaviour_map

    assert behaviour_map.MAP.read_text() == behaviour_map.render(), (
        "docs/testing-map.md is stale: run python tests/behaviour_map.py and read its diff")


def test_the_readme_is_short() -> None:
    size = len(README.read_bytes())
    assert size <= README_LIMIT, f"README.md is {size} bytes, over {README_LIMIT}: move detail into docs/"


def test_the_metrics_table_lists_every_exported_metric() -> None:
    source = (REPO / "platform" / "meshtrain" / "observe" / "metrics.py").read_text(encoding="utf-8")
    exported = set(re.findall(r'"(meshtrain_[a-z_]+)"', source))
    exported |= {f"meshtrain_cuda_memory_{name}_bytes" for name in ("allocated", "reserved", "peak_allocated")}
    table = (DOCS / "observability.md").read_text(encoding="utf-8")
    documented = set()
    for line in table.splitlines():
        if line.startswith("| `meshtrain_"):
            for code in re.findall(r"`(meshtrain_[^`]+)`", line.split("|")[1]):
                alternatives = re.fullmatch(r"([a-z_]+)\{([a-z_,]+)\}([a-z_]*)", code)
                if alternatives and "," in alternatives[2]:
                    parts = alternatives[2].split(",")
                    documented |= {alternatives[1] + part + alternatives[3] for part in parts}
                else:
                    documented.add(code.split("{")[0].removesuffix("_total"))
    missing = sorted(exported - documented)
    assert not missing, f"docs/observability.md's metrics table lacks {missing}"
