"""The lesson player (``lessons/player.py``) inside the app: a phase change happens in the browser and costs the
server nothing.

A lesson's player page is written once per lesson version into the app's static folder (``static/lessons/``, next to
``app.py``; Streamlit serves it at ``app/static/...`` with ``server.enableStaticServing``, set in
``.streamlit/config.toml``) and shown in an iframe by a small custom component (``st.components.v2``). Next, Back,
Play, the step jump, the race and its cost slider all run in the iframe: no script rerun, no websocket message. The
component only:

* forwards the player's keys (Right / Page Down / Space, Left / Page Up, Home, End, digits + Enter) pressed anywhere on
  the page outside a text field to the iframe, and moves the focus into the iframe when a lesson is picked, so a
  clicker keeps working after the teacher picked a lesson with the mouse;
* keeps the position the player reports (``postMessage``: run, step, phase) and sends it to Python only when
  **Continue live** is pressed (a trigger value): the one click that needs the server.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import streamlit as st

from ..lessons.lesson import Lesson
from ..lessons.player import player_html

STATIC_DIR = Path(__file__).resolve().parents[2] / "static"  # Streamlit's app static folder: beside app.py
LESSONS_URL = "app/static/lessons"  # where Streamlit serves STATIC_DIR / "lessons" (relative to the page's URL)

_HTML = """<div class="player-box"></div>
<div class="player-bar"><button class="live" title="load the embedded pair, replay this run to the step on screen and
go on stepping on the Explorer page">Continue live &#9654;</button><span class="where"></span></div>"""

# The component's own elements (Streamlit draws none of them), in the theme's variables.
_CSS = """
.player-box iframe { width: 100%; border: 0; display: block; }
.player-bar { display: flex; gap: 12px; align-items: center; padding: 4px 0; font-family: var(--st-font); }
.player-bar button { font-size: 16px; padding: 4px 14px; border-radius: var(--st-button-radius);
  border: 1px solid var(--st-border-color); background: var(--st-secondary-background-color); cursor: pointer; }
.player-bar .where { color: #555; font-size: 15px; }
"""

# Keys the player acts on; the others stay with the page (and stop the player's Play inside the iframe only).
_JS = """
const KEYS = ["ArrowRight", "ArrowLeft", "PageDown", "PageUp", " ", "Home", "End", "Enter",
              "0", "1", "2", "3", "4", "5", "6", "7", "8", "9"];
export default function ({ parentElement, data, setTriggerValue }) {
  const box = parentElement.querySelector(".player-box");
  let frame = box.querySelector("iframe");
  if (!frame || frame.dataset.src !== data.src) {
    box.innerHTML = "";
    frame = document.createElement("iframe");
    frame.dataset.src = data.src;
    frame.title = data.title;
    frame.src = data.src;
    // a new lesson: the focus leaves the lesson box for the player, so the clicker's keys reach it
    if (document.activeElement && document.activeElement.blur) { document.activeElement.blur(); }
    frame.addEventListener("load", () => frame.contentWindow.focus());
    box.appendChild(frame);
  }
  frame.style.height = data.height;
  let position = null;
  const where = parentElement.querySelector(".where");
  const onMessage = (e) => {
    if (e.source !== frame.contentWindow || !e.data || e.data.specPlayer !== "position") { return; }
    position = { run: e.data.run, step: e.data.step };
    where.textContent = e.data.where || "";
  };
  const onKey = (e) => {
    const t = e.target;
    if (t && (t.tagName === "INPUT" || t.tagName === "TEXTAREA" || t.tagName === "SELECT" || t.isContentEditable)) {
      return;
    }
    if (!KEYS.includes(e.key) || !frame.contentWindow) { return; }
    e.preventDefault();
    frame.contentWindow.postMessage({ specPlayer: "key", key: e.key }, "*");
  };
  window.addEventListener("message", onMessage);
  document.addEventListener("keydown", onKey, true);
  parentElement.querySelector(".live").onclick = () => { if (position) { setTriggerValue("live", position); } };
  return () => {
    window.removeEventListener("message", onMessage);
    document.removeEventListener("keydown", onKey, true);
  };
}
"""

_component = None


def _player_component():
    """The component, registered once per process (Streamlit keeps it per runtime)."""
    global _component
    if _component is None:
        _component = st.components.v2.component("lesson_player", html=_HTML, css=_CSS, js=_JS)
    return _component


_pages: dict[int, tuple[Lesson, Path]] = {}  # id(lesson) -> (the lesson, kept so the id stays its; its page)


def publish(lesson: Lesson, key: str) -> str:
    """Write ``lesson``'s player page into ``STATIC_DIR/lessons`` and return its URL relative to the app's pages.
    The page is built once per lesson object (the shipped lessons are shared by every session) and named by a digest
    of its content; ``key`` names the lesson in the file name (a shipped lesson's id, or ``file-<id>``), and older
    versions under the same name are removed.

    Raises:
        OSError: the static folder cannot be written.
    """
    folder = STATIC_DIR / "lessons"
    hit = _pages.get(id(lesson))
    if hit is not None and hit[0] is lesson and hit[1].parent == folder and hit[1].exists():
        return f"{LESSONS_URL}/{hit[1].name}"
    page = player_html(lesson)
    digest = hashlib.sha1(page.encode("utf-8")).hexdigest()[:12]
    stem = "".join(ch if ch.isalnum() or ch in "-_" else "-" for ch in key)
    path = folder / f"{stem}.{digest}.html"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(page, encoding="utf-8")
        tmp.replace(path)  # whole or not at all: another session may be reading the folder
        for old in folder.glob(f"{stem}.*.html"):
            if old != path:
                old.unlink(missing_ok=True)
    if len(_pages) > 64:
        _pages.clear()
    _pages[id(lesson)] = (lesson, path)
    return f"{LESSONS_URL}/{path.name}"


def static_serving() -> bool:
    """Whether this Streamlit serves the app's static folder (``server.enableStaticServing``)."""
    return bool(st.get_option("server.enableStaticServing"))


def lesson_player(url: str, title: str, height: str, key: str, on_live) -> None:
    """Mount the player of the page at ``url`` (``publish``) in an iframe ``height`` high (a CSS length), with
    **Continue live**: ``on_live`` runs (as a widget callback, before the script) when it is pressed; the position
    it reads is ``live_position`` of the value under ``key``."""
    _player_component()(data={"src": url, "title": title, "height": height}, key=key, on_live_change=on_live)


def live_position(value) -> tuple[int, int] | None:
    """The (run, step) the player showed when Continue live was pressed: from the component's value (what its key
    holds in the session) inside ``lesson_player``'s callback; None when it holds none."""
    live = getattr(value, "live", None) if value is not None else None
    if live is None and isinstance(value, dict):
        live = value.get("live")
    if not isinstance(live, dict):
        return None
    try:
        return int(live["run"]), int(live["step"])
    except (KeyError, TypeError, ValueError):
        return None
