"""Draw a chaos run as an SVG picture: leases as bars, writes as marks, pauses as shading."""

from __future__ import annotations

import html
from collections.abc import Callable, Iterable, Sequence

from fence._chaos.checker import Record

__all__ = ["render_svg"]

_COLORS = ["#4e79a7", "#f28e2b", "#59a14f", "#b07aa1", "#76b7b2", "#edc948", "#9c755f"]


def render_svg(records: Iterable[Record], title: str, *, width: int = 1200, lane: int = 34) -> str:
    """Return a standalone SVG document for one run.

    Each worker is a lane. A lease is a bar coloured by record, from ``acquired`` to
    ``released``/``lost``; grey shading marks the time a worker was stopped (SIGSTOP); a green
    dot is an accepted write, a red cross a rejected one; a black line is a server fault.
    """
    rows = sorted(records, key=lambda r: r.t)
    if not rows:
        return _document(width, 80, title, [])
    t0, t1 = rows[0].t, max(r.t for r in rows)
    span = max(t1 - t0, 1e-6)
    workers: list[str] = sorted({r.worker for r in rows if r.worker != "controller"})
    scopes: list[str] = sorted({r.scope for r in rows if r.scope})
    faults = [r for r in rows if r.event == "fault"]
    # Fault labels take two staggered rows above the lanes, so neighbours do not overlap.
    left, right, top = 110, 20, (56 if faults else 40)
    plot = width - left - right

    def x(t: float) -> float:
        return left + (t - t0) / span * plot

    parts: list[str] = []
    height = top + lane * len(workers) + 60
    parts.extend(_grid(t0, span, x, top, top + lane * len(workers)))
    for index, worker in enumerate(workers):
        y = top + index * lane
        parts.append(
            f'<text x="{left - 8}" y="{y + lane / 2 + 4}" text-anchor="end" '
            f'font-size="12">{html.escape(worker)}</text>'
        )
        parts.append(
            f'<line x1="{left}" x2="{width - right}" y1="{y + lane - 2}" y2="{y + lane - 2}" '
            'stroke="#eee"/>'
        )
        mine = [r for r in rows if r.worker == worker]
        parts.extend(_bars(mine, x, y, lane, scopes, t1))
        parts.extend(_marks(mine, x, y, lane))
    for number, fault in enumerate(faults):
        fx = x(fault.t)
        row_y = top - 8 - 12 * (number % 2)
        parts.append(
            f'<line x1="{fx:.1f}" x2="{fx:.1f}" y1="{row_y - 8}" y2="{height - 50}" '
            'stroke="#000" stroke-width="1.5" stroke-dasharray="4 3"/>'
        )
        label = fault.detail or "fault"
        # About 5.5 px per character at this size: a label that would run off the right
        # edge ends at its line instead of starting there.
        anchor = (
            f'x="{fx - 3:.1f}" text-anchor="end"'
            if fx + 3 + 5.5 * len(label) > width
            else f'x="{fx + 3:.1f}"'
        )
        parts.append(f'<text {anchor} y="{row_y}" font-size="10">{html.escape(label)}</text>')
    parts.extend(_legend(scopes, left, height - 30))
    parts.append(
        f'<text x="{left}" y="{height - 8}" font-size="11" fill="#555">0 s … {span:.1f} s</text>'
    )
    return _document(width, height, title, parts)


def _grid(
    t0: float, span: float, x: Callable[[float], float], top: float, bottom: float
) -> list[str]:
    """Light vertical lines with a seconds label, at most a dozen across the picture."""
    step = next((s for s in (0.5, 1, 2, 5, 10, 30, 60, 300, 600) if span / s <= 12), 3600.0)
    out: list[str] = []
    count = int(span / step) + 1
    for i in range(count):
        offset = i * step
        gx = x(t0 + offset)
        out.append(f'<line x1="{gx:.1f}" x2="{gx:.1f}" y1="{top}" y2="{bottom}" stroke="#f0f0f0"/>')
        out.append(
            f'<text x="{gx:.1f}" y="{bottom + 12}" text-anchor="middle" font-size="10" '
            f'fill="#777">{offset:g} s</text>'
        )
    return out


def _bars(
    rows: Sequence[Record],
    x: Callable[[float], float],
    y: float,
    lane: int,
    scopes: list[str],
    end: float,
) -> list[str]:
    out: list[str] = []
    open_lease: Record | None = None
    paused_at: float | None = None
    for r in rows:
        if r.event == "acquired":
            open_lease = r
        elif r.event in ("released", "lost") and open_lease is not None:
            out.append(_bar(open_lease, r.t, x, y, lane, scopes, lost=r.event == "lost"))
            open_lease = None
        elif r.event == "paused":
            paused_at = r.t
        elif r.event == "resumed" and paused_at is not None:
            out.append(
                f'<rect x="{x(paused_at):.1f}" y="{y + 2}" '
                f'width="{max(x(r.t) - x(paused_at), 1):.1f}" height="{lane - 6}" '
                'fill="#999" fill-opacity="0.35"><title>stopped (SIGSTOP)</title></rect>'
            )
            paused_at = None
    if open_lease is not None:
        out.append(_bar(open_lease, end, x, y, lane, scopes, lost=False))
    return out


def _bar(
    start: Record,
    end: float,
    x: Callable[[float], float],
    y: float,
    lane: int,
    scopes: list[str],
    lost: bool,
) -> str:
    color = _COLORS[scopes.index(start.scope) % len(_COLORS)] if start.scope in scopes else "#888"
    label = html.escape(f"{start.scope} token {start.token}" + (" (lost)" if lost else ""))
    dash = ' stroke="#d62728" stroke-dasharray="3 2"' if lost else ""
    return (
        f'<rect x="{x(start.t):.1f}" y="{y + 8}" width="{max(x(end) - x(start.t), 1):.1f}" '
        f'height="{lane - 18}" fill="{color}" fill-opacity="0.55"{dash}>'
        f"<title>{label}</title></rect>"
    )


def _marks(rows: Sequence[Record], x: Callable[[float], float], y: float, lane: int) -> list[str]:
    out: list[str] = []
    mid = y + lane / 2
    for r in rows:
        label = html.escape(f"{r.event} {r.scope} token {r.token} {r.before}->{r.after}")
        if r.event == "write_ok":
            out.append(
                f'<circle cx="{x(r.t):.1f}" cy="{mid:.1f}" r="3" fill="#2ca02c">'
                f"<title>{label}</title></circle>"
            )
        elif r.event == "write_rejected":
            cx = x(r.t)
            out.append(
                f'<path d="M{cx - 4:.1f},{mid - 4:.1f} l8,8 m0,-8 l-8,8" stroke="#d62728" '
                f'stroke-width="2"><title>{label}</title></path>'
            )
    return out


def _legend(scopes: list[str], left: int, y: float) -> list[str]:
    items = [
        '<circle cx="{0}" cy="{1}" r="3" fill="#2ca02c"/>',
        '<path d="M{0},{1} m-4,-4 l8,8 m0,-8 l-8,8" stroke="#d62728" stroke-width="2"/>',
        (
            '<rect x="{0}" y="{1}" width="12" height="8" fill="#999" fill-opacity="0.35" '
            'transform="translate(-6,-4)"/>'
        ),
    ]
    labels = ["accepted write", "rejected write", "stopped"]
    out = []
    cx = left
    for shape, label in zip(items, labels, strict=True):
        out.append(shape.format(cx, y))
        out.append(f'<text x="{cx + 8}" y="{y + 4}" font-size="11">{label}</text>')
        cx += 120
    for i, scope in enumerate(scopes[:6]):
        color = _COLORS[i % len(_COLORS)]
        out.append(
            f'<rect x="{cx}" y="{y - 5}" width="14" height="10" fill="{color}" '
            'fill-opacity="0.55"/>'
        )
        out.append(
            f'<text x="{cx + 18}" y="{y + 4}" font-size="11">lease on {html.escape(scope)}</text>'
        )
        cx += 140
    return out


def _document(width: int, height: int, title: str, parts: list[str]) -> str:
    body = "\n".join(parts)
    return (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif">\n'
        f'<rect width="100%" height="100%" fill="#fff"/>\n'
        f'<text x="10" y="20" font-size="14" font-weight="bold">{html.escape(title)}</text>\n'
        f"{body}\n</svg>\n"
    )
