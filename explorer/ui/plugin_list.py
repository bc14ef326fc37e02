"""The plugins the app was started with: loaded once per server process from ``SPEC_EXPLORER_PLUGINS`` and the
installed packages' entry points (``plugins/loading.py``), and listed in the sidebar with where each came from.
Nothing a browser sends is ever loaded: there is no upload of plugins."""

from __future__ import annotations

import html

import streamlit as st

from ..plugins.loading import ENV, LoadedPlugin, load_plugins, loaded_plugins


@st.cache_resource(show_spinner=False)
def startup_plugins() -> tuple[list[LoadedPlugin], str | None]:
    """Load the start-up plugins once for the server (every session shares the registries); returns the loaded
    plugins and the message of the one that failed (the app stays up without it), or None."""
    try:
        load_plugins()
    except Exception as exc:  # noqa: BLE001 - a plugin's failure is shown, the app goes on
        return loaded_plugins(), str(exc)
    return loaded_plugins(), None


def plugin_section(box) -> None:
    """The sidebar's list of loaded plugins (name, what each registered, where from, version, sha256), and a
    plugin that failed to load; nothing when the server was started without plugins."""
    plugins, problem = startup_plugins()
    plugins = [p for p in plugins if p.how != "bundled"]  # the project's own methods are not the user's plugins
    if not plugins and not problem:
        return
    box.header("Plugins")
    for p in plugins:
        version = f" {p.version}" if p.version else ""
        digest = f" · sha256 {p.sha256[:12]}" if p.sha256 else ""
        box.markdown(f"**{html.escape(p.name)}**{html.escape(version)}: "
                     + (", ".join(f"`{html.escape(n)}`" for n in p.registered) or "registered nothing"))
        box.caption(f"{html.escape(p.how)}: {html.escape(p.loaded_from)}{digest}")
    if problem:
        box.error(f"A plugin did not load: {problem}")
    box.caption(f"Loaded at start-up from {ENV} and installed packages; the app never runs code sent by a browser.")
