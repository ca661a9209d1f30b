#!/usr/bin/env python3
"""Check that every internal link of the built docs site resolves.

    python tools/check_links.py build/docs/html

Reads every ``.html`` file under the folder and follows each ``href`` and ``src`` that
stays inside the site (no scheme, no host): the file it names must exist, and a
``#fragment`` must be an ``id`` (or an ``<a name>``) of that page. Addresses outside the
site are not fetched: the check runs offline, and a page of another site going away is not
a fault of this one. Sphinx's ``-W`` already fails on a cross-reference it cannot resolve;
this catches what it lets through (a Markdown link to a page or an anchor that is not
there, a theme's or an extension's own links).

The highlighted source pages (``_modules/``, from ``sphinx.ext.viewcode``) have their files
checked but not their anchors: their "[docs]" links to the members of a class that two
public modules export (``fence.ManualClock``, ``fence.testing.ManualClock``) use the first
name, while the members are documented under the second.

Exit status 0 when every link resolves; 1 otherwise, each broken link on a line of its own.
"""

from __future__ import annotations

import argparse
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit


class _Page(HTMLParser):
    """The links and the anchors of one HTML page."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.links: list[str] = []
        self.anchors: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        for name, value in attrs:
            if value is None:
                continue
            if name == "id" or (tag == "a" and name == "name"):
                self.anchors.add(value)
            elif name in ("href", "src"):
                self.links.append(value)


def _read(path: Path) -> _Page:
    page = _Page()
    page.feed(path.read_text(encoding="utf-8"))
    page.close()
    return page


def broken_links(site: Path) -> list[str]:
    """Every internal link of the HTML files under ``site`` that does not resolve.

    Args:
        site: the built site's root folder.

    Returns:
        One line per broken link, ``page: link (why)``, in page order.
    """
    site = site.resolve()
    pages = {path: _read(path) for path in sorted(site.rglob("*.html"))}
    broken = []
    for path, page in pages.items():
        for link in page.links:
            parts = urlsplit(link)
            if parts.scheme or parts.netloc or link.startswith("//"):
                continue  # another site, mailto:, data:, javascript:
            if not parts.path:
                target = path
            else:
                target = (path.parent / unquote(parts.path)).resolve()
                if target.is_dir():
                    target = target / "index.html"
            where = f"{path.relative_to(site)}: {link}"
            if not target.is_relative_to(site):
                broken.append(f"{where} (outside the site)")
                continue
            if not target.is_file():
                broken.append(f"{where} (no such file)")
                continue
            fragment = unquote(parts.fragment)
            source_page = path.relative_to(site).parts[0] == "_modules"
            if fragment and target.suffix == ".html" and not source_page:
                anchors = pages[target].anchors if target in pages else _read(target).anchors
                if fragment not in anchors:
                    broken.append(f"{where} (no anchor {fragment!r})")
    return broken


def main() -> int:
    """Check the site given on the command line; print what is broken."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", type=Path, help="the built site, e.g. build/docs/html")
    args = parser.parse_args()
    if not (args.site / "index.html").is_file():
        print(f"check_links: no site at {args.site} (no index.html)")
        return 1
    broken = broken_links(args.site)
    for line in broken:
        print(line)
    count = sum(1 for _ in args.site.rglob("*.html"))
    print(f"check_links: {count} pages, {len(broken)} broken internal links")
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
