"""Pictures of form-filling episodes: the page as the policy left it, and why it scored what it did.

One PNG per episode (:func:`compose_snapshot`): on the left the browser's screenshot of the
filled form, taken just before the script's submit click (the page after the last action when
the script never submits); on the right a text panel with the task's instruction, the model's
action script, every gold field's submitted value marked right or wrong (with the gold value
where it differs), the server's verdict and the reward's components with their weights.

The scorer composes the pictures of the episodes it is asked for and returns them as PNG bytes
(:func:`snapshot_item`); the driver writes them with :func:`save_snapshots` to
``media/forms/<label>_<k>_<task id>.png`` (``k``: the evaluation task's number).
"""

from __future__ import annotations

import io
from pathlib import Path

from flowrl_ray.envs.forms.reward import COMPONENTS, EpisodeResult, RewardWeights
from flowrl_ray.envs.forms.spec import FormSpec
from flowrl_ray.envs.forms.tasks import FormTask, format_value

SHOT_MAX_W, SHOT_MAX_H = 760, 1400        # the screenshot is scaled down to fit (pixels)
PANEL_W = 620                             # text panel width (pixels)
PAD = 12
FONT_PX = 14
LINE_PX = 18
MAX_SCRIPT_LINES = 30                     # longer scripts are cut, with a count of what was left out
RIGHT, WRONG, INK, MUTED = (20, 130, 40), (190, 30, 30), (20, 20, 20), (110, 110, 110)


def _font(size: int = FONT_PX):
    from PIL import ImageFont
    return ImageFont.load_default(size=size)


def _wrap(text: str, font, width: int) -> list[str]:
    """``text`` broken into lines no wider than ``width`` pixels (words longer than a line are
    cut character by character); the text's own newlines are kept."""
    out = []
    for para in str(text).splitlines() or [""]:
        line = ""
        for word in para.split(" "):
            cand = word if not line else f"{line} {word}"
            if font.getlength(cand) <= width:
                line = cand
                continue
            if line:
                out.append(line)
            while font.getlength(word) > width:           # a single over-long word
                cut = max(1, next((i for i in range(len(word), 0, -1) if font.getlength(word[:i]) <= width), 1))
                out.append(word[:cut])
                word = word[cut:]
            line = word
        out.append(line)
    return out


def field_lines(form: FormSpec | None, task: FormTask | None, result: EpisodeResult) -> list[tuple[str, bool | None]]:
    """(text, right?) per gold field: 'Label: submitted' when right, 'Label: submitted (gold:
    X)' when wrong; right is None when the episode had no gold task."""
    if task is None or form is None:
        return [(f"{k}: {v}", None) for k, v in result.submitted_values.items()]
    lines = []
    for name, gold in task.ground_truth_fields.items():
        try:
            f = form.field(name)
            label, want = f.label, format_value(f, gold)
        except KeyError:
            label, want = name, str(gold)
        got = result.submitted_values.get(name) if result.submitted else None
        shown = "(not submitted)" if got is None else (", ".join(map(str, got)) if isinstance(got, list) else str(got))
        ok = bool(result.field_matches.get(name, False))
        lines.append((f"{label}: {shown}" if ok else f"{label}: {shown}  (gold: {want})", ok))
    return lines


def panel_text(task: FormTask | None, text: str, result: EpisodeResult, form: FormSpec | None,
               weights: RewardWeights | None = None) -> list[tuple[str, tuple[int, int, int], bool]]:
    """The panel's lines before wrapping: (text, colour, bold heading?)."""
    w = weights or RewardWeights()
    lines: list[tuple[str, tuple[int, int, int], bool]] = []
    head = lambda s: lines.append((s, INK, True))            # noqa: E731
    body = lambda s, c=INK: lines.append((s, c, False))      # noqa: E731
    title = form.title if form is not None else result.form_id
    head(f"{title}  [{result.task_id or result.form_id}]")
    if task is not None:
        head("Instruction")
        body(task.instruction)
    head("Action script")
    script = [ln for ln in str(text).splitlines() if ln.strip()]
    for ln in script[:MAX_SCRIPT_LINES]:
        body(ln, MUTED)
    if len(script) > MAX_SCRIPT_LINES:
        body(f"... {len(script) - MAX_SCRIPT_LINES} more lines", MUTED)
    if not script:
        body("(empty)", MUTED)
    head("Submitted vs gold")
    fields = field_lines(form, task, result)
    for s, ok in fields:
        body(("[ok] " if ok else "[x] " if ok is False else "") + s, RIGHT if ok else WRONG if ok is False else INK)
    if not fields:
        body("(no fields)", MUTED)
    head("Outcome")
    if result.reason:
        body(f"gated: {result.reason} (reward 0)", WRONG)
    elif not result.submitted:
        body("not submitted", WRONG)
    else:
        body("accepted by the server" if result.accepted else "rejected by the server",
             RIGHT if result.accepted else WRONG)
    for err in result.submission_errors[:5]:
        body(f"  {err}", WRONG)
    body(f"actions {result.actions}, executed {result.executed}, unparseable lines {result.unparseable_lines}")
    for err in result.errors[:3]:
        body(f"  {err}", MUTED)
    head(f"Reward {result.reward:.3f}")
    for name in COMPONENTS:
        value = getattr(result, name)
        body(f"{name} {'-' if value is None else f'{value:.3f}'} x {getattr(w, name):g}")
    return lines


def compose_snapshot(screenshot: bytes | None, task: FormTask | None, text: str, result: EpisodeResult,
                     form: FormSpec | None, weights: RewardWeights | None = None) -> bytes:
    """One PNG: the screenshot (cropped to the page's content, scaled to fit SHOT_MAX_W x
    SHOT_MAX_H; a grey box saying why when there is none) on the left, :func:`panel_text` on the
    right; as tall as the taller of the two."""
    from PIL import Image, ImageDraw, ImageOps
    font, bold = _font(), _font(FONT_PX + 2)
    if screenshot:
        shot = Image.open(io.BytesIO(screenshot)).convert("RGB")
        content = ImageOps.invert(shot.convert("L")).getbbox()          # the page's non-white part
        if content is not None:
            x0, y0, x1, y1 = content
            shot = shot.crop((max(0, x0 - PAD), max(0, y0 - PAD),
                              min(shot.width, x1 + PAD), min(shot.height, y1 + PAD)))
        scale = min(1.0, SHOT_MAX_W / shot.width, SHOT_MAX_H / shot.height)
        if scale < 1.0:
            shot = shot.resize((max(1, round(shot.width * scale)), max(1, round(shot.height * scale))))
    else:
        shot = Image.new("RGB", (SHOT_MAX_W // 2, 200), (225, 225, 225))
        ImageDraw.Draw(shot).text((PAD, PAD), f"no page to show\n({result.reason or 'no screenshot'})",
                                  fill=INK, font=font)
    wrapped = []                                          # (line, colour, font, height)
    for s, colour, is_head in panel_text(task, text, result, form, weights):
        f = bold if is_head else font
        for ln in _wrap(s, f, PANEL_W - 2 * PAD):
            wrapped.append((ln, colour, f, LINE_PX + (4 if is_head else 0)))
    panel_h = 2 * PAD + sum(h for *_, h in wrapped)
    canvas = Image.new("RGB", (shot.width + PANEL_W, max(shot.height, panel_h)), "white")
    canvas.paste(shot, (0, 0))
    draw = ImageDraw.Draw(canvas)
    draw.line([(shot.width, 0), (shot.width, canvas.height)], fill=(200, 200, 200), width=1)
    y = PAD
    for ln, colour, f, h in wrapped:
        draw.text((shot.width + PAD, y + h - LINE_PX), ln, fill=colour, font=f)
        y += h
    buf = io.BytesIO()
    canvas.save(buf, format="PNG")
    return buf.getvalue()


def snapshot_item(index: int, screenshot: bytes | None, task: FormTask | None, text: str, result: EpisodeResult,
                  form: FormSpec | None, weights: RewardWeights | None = None) -> dict:
    """What a scorer returns for one pictured episode: {"index", "task_id", "png", "caption"}."""
    accuracy = "-" if result.field_accuracy is None else f"{result.field_accuracy:.2f}"
    caption = (f"{result.task_id or result.form_id}: reward {result.reward:.3f}, field accuracy {accuracy}, "
               f"{'accepted' if result.accepted else result.reason or 'not accepted'}")
    return {"index": int(index), "task_id": str(result.task_id or result.form_id),
            "png": compose_snapshot(screenshot, task, text, result, form, weights), "caption": caption}


def save_snapshots(items: list[dict], media_dir: str | Path, label: str) -> list[tuple[Path, str]]:
    """Write each item's PNG to ``media_dir/forms/<label>_<index>_<task id>.png`` (the id's
    slashes become dashes), in index order. -> [(path, caption)]."""
    out = Path(media_dir) / "forms"
    written = []
    for it in sorted(items, key=lambda it: it["index"]):
        out.mkdir(parents=True, exist_ok=True)
        safe = "".join(c if c.isalnum() or c in "-_." else "-" for c in it["task_id"])
        path = out / f"{label}_{it['index']}_{safe}.png"
        tmp = path.with_suffix(".png.tmp")
        tmp.write_bytes(it["png"])
        tmp.replace(path)
        written.append((path, it["caption"]))
    return written
