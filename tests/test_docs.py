"""The README is the front door and docs/ the manual: the README stays short, every relative link in them resolves
(the file, and the heading an `#anchor` names), docs/README.md indexes every page, and the headline job's figures
quoted in them are the ones `plan` prints today."""

from __future__ import annotations

import re
from functools import cache
from pathlib import Path

from dflash_stream.config import load_config
from dflash_stream.observe.plan import build_plan, render_release
from dflash_stream.sizing.memory import parse_size
from dflash_stream.units import fmt_bytes, fmt_duration

ROOT = Path(__file__).resolve().parent.parent
README_MAX_BYTES = 12_000

FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.M)


def _prose(text: str) -> str:
    """The text without fenced code blocks and code spans, where brackets are code, not links."""
    return CODE_SPAN.sub("", FENCE.sub("", text))


def anchors(text: str) -> set[str]:
    """GitHub's anchors for a page's headings: lower case, punctuation dropped, spaces as hyphens, a repeated
    heading numbered -1, -2, ..."""
    seen: dict[str, int] = {}
    out = set()
    for title in HEADING.findall(FENCE.sub("", text)):
        title = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", title)  # a link in a heading counts by its text
        slug = re.sub(r"[^\w\- ]", "", title.replace("`", "").lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(pages: list[Path]) -> list[str]:
    """`page: target` for every relative link whose file does not exist or whose #anchor names no heading."""
    broken = []
    for page in pages:
        for target in LINK.findall(_prose(page.read_text())):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto: ...: not ours to check
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and (file.suffix != ".md" or anchor not in anchors(file.read_text())):
                broken.append(f"{page.name}: {target} (no such heading in {file.name})")
    return broken


def doc_pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_readme_is_at_most_12000_bytes():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= README_MAX_BYTES, f"README.md is {size:,} bytes; move detail into a page of docs/"


def test_every_relative_link_resolves():
    assert broken_links(doc_pages()) == []


def test_docs_index_lists_every_page():
    index = (ROOT / "docs" / "README.md").read_text()
    linked = {Path(t.partition("#")[0]).name for t in LINK.findall(_prose(index))}
    pages = {p.name for p in (ROOT / "docs").glob("*.md")} - {"README.md"}
    assert pages <= linked, f"docs/README.md does not link {sorted(pages - linked)}"
    assert "docs/README.md" in (ROOT / "README.md").read_text()


def test_a_broken_link_or_anchor_is_caught(tmp_path):
    """The check itself can fail: a missing file, a missing heading, and links in code that are not links."""
    (tmp_path / "other.md").write_text("# Other page\n\n## The headline job's plan\n\n## Keys (`store` section)\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md) [ok](other.md#the-headline-jobs-plan) [ok](other.md#keys-store-section) [ok](#here)\n"
        "[gone](missing.md) [bad anchor](other.md#nowhere) [web](https://example.com/x.md)\n"
        "`[code](not-a-link.md)`\n\n```\n[fenced](not-a-link.md)\n```\n\n## Here\n")
    found = broken_links([page])
    assert len(found) == 2 and "missing.md" in found[0] and "other.md#nowhere" in found[1], found


# The README's headline command: `plan --config configs/qwen3.6-27b-4gpu.yaml --launch launch/4gpu.yaml --gpu-memory
# 96GB`, and the same launch for the config whose answers come from vLLM servers.
HEADLINE_CONFIGS = ("qwen3.6-27b-4gpu.yaml", "qwen3.6-27b-4gpu-vllm.yaml")


@cache
def headline_plan(config: str) -> dict:
    return build_plan(load_config(ROOT / "configs" / config), launch_file=str(ROOT / "launch" / "4gpu.yaml"),
                      gpu_memory=parse_size("96GB"))


def spaced(duration: str) -> str:
    """The README's spelling of `fmt_duration`'s "11d 6h": "11 d 6 h"."""
    return re.sub(r"(\d)([dhms])\b", r"\1 \2", duration)


def test_the_readmes_headline_figures_are_what_plan_prints():
    """The README quotes the headline plan by hand; a change to a rate, a size rule or a default must change the
    quote with it (each figure as plan formats it, in the README's spacing)."""
    plan, served = headline_plan(HEADLINE_CONFIGS[0]), headline_plan(HEADLINE_CONFIGS[1])
    mem, roles, t, c = plan["memory"], plan["roles"], plan["time"], plan["time"]["checkpoints"]
    on_use = c["rules"]["on_use"]
    quoted = {
        "memory": f"extractor {fmt_bytes(mem['extractor']['total_bytes'])}, trainer "
                  f"{fmt_bytes(mem['trainer']['total_bytes'])}, of {fmt_bytes(mem['usable_bytes'])} usable",
        "host": f"host RAM up to {fmt_bytes(plan['host_memory']['machine']['bytes'])} for the four processes'",
        "split": f"{roles['extractors']} extractors + {roles['trainers']} trainers",
        "regeneration": f"regeneration {spaced(fmt_duration(t['phases']['data']['seconds']))}",
        "extraction": f"extraction {spaced(fmt_duration(t['phases']['extract']['seconds']))}",
        "training": f"training {spaced(fmt_duration(t['phases']['train']['seconds']))}",
        "total": f"side by side **{spaced(fmt_duration(t['total_seconds']))}**",
        "total with servers": f"**{spaced(fmt_duration(served['time']['total_seconds']))}** with four vLLM servers",
        "disk": f"**{plan['disk']['total_bytes'] / 1e9:.1f} GB of",
        "checkpoints": f"{c['count']} × {fmt_bytes(c['bytes'])}, one every {c['every_seconds'] / 60:.0f} m",
        "stall": f"{100 * c['stall_fraction']:.2f} % of training stopped",
        "crash": f"≤ {spaced(fmt_duration(on_use['training_lost_seconds']))} of training + "
                 f"{spaced(fmt_duration(on_use['reextract_seconds']))} of re-extraction",
    }
    readme = (ROOT / "README.md").read_text()
    stale = {what: figure for what, figure in quoted.items() if figure not in readme}
    assert not stale, f"README.md's headline table no longer says what plan prints: {stale}"


def test_docs_plan_quotes_what_plan_prints():
    """docs/plan.md shows `plan`'s release section for the served headline config verbatim, and the headline's host
    memory per role."""
    page = (ROOT / "docs" / "plan.md").read_text()
    release = "\n".join(render_release(headline_plan(HEADLINE_CONFIGS[1])["time"]["checkpoints"]))
    assert release in page, f"docs/plan.md: the release section is now\n{release}"
    host = headline_plan(HEADLINE_CONFIGS[0])["host_memory"]
    trainer = host["trainer"]["parts"]
    for figure in (f"extractor up to {fmt_bytes(host['extractor']['total_bytes'])}",
                   f"trainer up to {fmt_bytes(host['trainer']['total_bytes'] - trainer['checkpoint_snapshot'])}",
                   f"trainer 0 another {fmt_bytes(trainer['checkpoint_snapshot'])}",
                   f"together up to {fmt_bytes(host['machine']['bytes'])}"):
        assert figure in page, f"docs/plan.md's host memory row: {figure!r} is what plan prints"
