"""The measured results and the pages that cite them agree: every file a page cites under
`benchmarks/results/` exists, and every file there belongs to an output a page names (its name,
or the output's name it starts with: `<output>_train.png` belongs to `<output>`)."""

import itertools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def _expand(pattern: str) -> list[str]:
    """`a_{x,y}.{json,md}` -> a_x.json, a_x.md, a_y.json, a_y.md (the pages' shorthand)."""
    parts = re.split(r"\{([^{}]*)\}", pattern)
    choices = [[p] if i % 2 == 0 else p.split(",") for i, p in enumerate(parts)]
    return ["".join(c) for c in itertools.product(*choices)]


def _cited_paths(text: str) -> set[str]:
    out = set()
    for m in re.finditer(r"benchmarks/results/([\w.\-{},]+)", text):
        pattern = m.group(1).rstrip(".,")
        if pattern and not pattern.endswith("/"):
            out.update(_expand(pattern))
    return out


def test_expand_reads_the_pages_shorthand():
    assert _expand("a_{x,y}.{json,md}") == ["a_x.json", "a_x.md", "a_y.json", "a_y.md"]
    assert _cited_paths("see `benchmarks/results/p_{train,eval}.png`, and benchmarks/results/q.md.") == \
        {"p_train.png", "p_eval.png", "q.md"}


def test_every_cited_results_file_exists():
    missing = sorted({(page.relative_to(ROOT).as_posix(), name) for page in PAGES
                      for name in _cited_paths(page.read_text()) if not (RESULTS / name).exists()})
    assert not missing, f"cited but not in benchmarks/results/: {missing}"


def test_every_results_file_belongs_to_an_output_a_page_names():
    text = "\n".join(page.read_text() for page in PAGES)
    words = set(re.findall(r"[\w\-]+", text)) | {Path(n).stem for n in _cited_paths(text)}

    def named(file: str) -> bool:
        parts = file.split(".")[0].split("_")
        return any("_".join(parts[:k]) in words for k in range(len(parts), 1, -1))

    orphans = sorted(f.name for f in RESULTS.iterdir() if f.is_file() and not named(f.name))
    assert not orphans, f"in benchmarks/results/ but no page names their output: {orphans}"


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens."""
    return {re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            for m in re.finditer(r"^#+ (.*)$", page.read_text(), re.M)}


def test_every_link_to_a_section_of_a_page_names_a_heading_it_has():
    """Results sections get merged and renamed; a link to one of them, from another page or from
    the same page (`[x](#anchor)`), must follow."""
    assert _anchors_of_text("## FlowSAR on Lift (state): t_mid, beta and T") == {"flowsar-on-lift-state-t_mid-beta-and-t"}
    broken = []
    for page in PAGES:
        for m in re.finditer(r"\]\(([^)#\s]*\.md)#([^)\s]+)\)", page.read_text()):
            target = (page.parent / m.group(1)).resolve()
            if target.is_file() and m.group(2) not in _anchors(target):
                broken.append((page.relative_to(ROOT).as_posix(), f"{m.group(1)}#{m.group(2)}"))
        own = _anchors(page)
        broken += [(page.relative_to(ROOT).as_posix(), f"#{a}")
                   for a in re.findall(r"\]\(#([^)\s]+)\)", page.read_text()) if a not in own]
    assert not broken, broken


def _anchors_of_text(text: str) -> set[str]:
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".md", delete=False) as f:
        f.write(text + "\n")
    return _anchors(Path(f.name))
