"""Loading plugins: files and modules named on the command line (``--plugin``) or in ``SPEC_EXPLORER_PLUGINS``, and
installed packages' entry points in the group ``spec_explorer.plugins``.

A plugin is Python that registers parts when imported (``explorer.plugins.register_method`` and the others) or an
entry point naming a function that does so when called. Only what the server or the command line was started with
is loaded: nothing a browser sends is ever run. Each plugin loads once per process; what it registered, where it
came from, its version and its file's sha256 are kept (``loaded_plugins``) for the sidebar and the traces.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from ..engine.parts import PluginError
from .registry import loading_as, sha256_of

ENV = "SPEC_EXPLORER_PLUGINS"
"""Paths or module names separated by ``os.pathsep``; ``off`` loads no plugin at all, entry points included."""
ENTRY_POINT_GROUP = "spec_explorer.plugins"
PLUGIN_FLAG, NO_PLUGINS_FLAG = "--plugin", "--no-plugins"


@dataclass
class LoadedPlugin:
    """One loaded plugin.

    Attributes:
        name: the module's name (a file's stem, a module path, an entry point's name).
        loaded_from: the file's absolute path, ``module NAME`` or ``entry point GROUP:NAME (VALUE)``.
        how: ``file``, ``module``, ``entry point`` or ``bundled`` (the project's own, ``load_bundled``).
        version: the distribution's version for an installed package, else None.
        sha256: the hex sha256 of the plugin's source file, where it has one.
        registered: the method, verifier and stop-policy names it registered.
    """

    name: str
    loaded_from: str
    how: str
    version: str | None = None
    sha256: str | None = None
    registered: list[str] = field(default_factory=list)

    def origin(self) -> dict:
        """What the traces record of it (``settings["plugins"]``); ``bundled`` where it is the project's own."""
        return {"name": self.name, "loaded_from": self.loaded_from, "version": self.version, "sha256": self.sha256,
                **({"bundled": True} if self.how == "bundled" else {})}


_LOADED: dict[str, LoadedPlugin] = {}  # key (resolved path, module or entry point) -> the plugin


def loaded_plugins() -> list[LoadedPlugin]:
    """Every plugin loaded in this process, in load order."""
    return list(_LOADED.values())


def _is_path(spec: str) -> bool:
    return spec.endswith(".py") or os.sep in spec or (os.altsep is not None and os.altsep in spec)


def _module_file(module: str) -> str | None:
    """The source file of an importable module, found without running it (its parent packages are imported); None
    where there is none. Raises PluginError where the module cannot be found."""
    try:
        found = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:
        raise PluginError(f"plugin {module}: no such module (not a .py path, and not importable here: {exc})") from None
    if found is None:
        raise PluginError(f"plugin {module}: no such module (not a .py path, and not importable here)")
    return found.origin if found.has_location else None


def load_plugin(spec: str, how: str = "module") -> LoadedPlugin:
    """Load one plugin: a ``.py`` file or folder path (a package's ``__init__.py``), or an importable module name.
    Loading the same file or module again returns the first load. ``how``: what the load of a module is called
    (``bundled`` for the project's own, ``load_bundled``).

    Raises PluginError naming the plugin: no such file or module, or importing it raised (a syntax error, a name
    already taken, ...); what it registered before failing is taken back."""
    spec = str(spec).strip()
    if not spec:
        raise PluginError("an empty plugin name: give a .py file or a module name")
    if _is_path(spec) or Path(spec).exists():
        path = Path(spec).expanduser().resolve()
        if path.is_dir():
            path = path / "__init__.py"
        key = str(path)
        if key in _LOADED:
            return _LOADED[key]
        if not path.is_file():
            raise PluginError(f"plugin {spec}: no such file")
        name = path.parent.name if path.name == "__init__.py" else path.stem
        plugin = LoadedPlugin(name, str(path), "file", None, sha256_of(path))
        with _importing(plugin) as record:
            module_name = f"spec_explorer_plugin_{name}"
            found = importlib.util.spec_from_file_location(module_name, path)
            if found is None or found.loader is None:
                raise PluginError(f"plugin {spec}: not a Python file")
            module = importlib.util.module_from_spec(found)
            sys.modules[module_name] = module
            try:
                found.loader.exec_module(module)
            except BaseException:
                sys.modules.pop(module_name, None)
                raise
    else:
        key = f"module {spec}"
        if key in _LOADED:
            return _LOADED[key]
        plugin = LoadedPlugin(spec, key, how, _version_of(spec), sha256_of(_module_file(spec)))
        with _importing(plugin) as record:
            importlib.import_module(spec)
    plugin.registered = record.names()
    _LOADED[key] = plugin
    return plugin


class _importing:
    """Import a plugin with its registrations attributed to it; any failure becomes a PluginError that names it
    (and its registrations are taken back)."""

    def __init__(self, plugin: LoadedPlugin):
        self.plugin = plugin

    def __enter__(self):
        self._ctx = loading_as(self.plugin.origin())
        return self._ctx.__enter__()

    def __exit__(self, kind, exc, tb):
        self._ctx.__exit__(kind, exc, tb)  # takes the registrations back on failure
        if exc is None or not isinstance(exc, Exception):
            return False
        if isinstance(exc, PluginError) and str(exc).startswith(f"plugin {self.plugin.name}"):
            return False
        if isinstance(exc, ModuleNotFoundError) and self.plugin.how == "module" and exc.name == self.plugin.name:
            raise PluginError(f"plugin {self.plugin.name}: no such module (not a .py path, and not importable "
                              "here)") from None
        where = ""
        if isinstance(exc, SyntaxError) and exc.lineno:
            where = f" (line {exc.lineno})"
        raise PluginError(f"plugin {self.plugin.name} ({self.plugin.loaded_from}): loading it raised "
                          f"{type(exc).__name__}{where}: {exc}") from exc


def _version_of(module: str) -> str | None:
    """The installed distribution version of a top-level module, where one provides it."""
    from importlib import metadata

    top = module.split(".")[0]
    for dist in metadata.packages_distributions().get(top, []):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def load_entry_points() -> list[LoadedPlugin]:
    """Load every installed package's entry point in ``ENTRY_POINT_GROUP``: one naming a module registers on import,
    one naming a callable is called with no arguments. Raises PluginError naming the entry point that failed."""
    from importlib import metadata

    out = []
    for ep in metadata.entry_points(group=ENTRY_POINT_GROUP):
        key = f"entry point {ENTRY_POINT_GROUP}:{ep.name} ({ep.value})"
        if key in _LOADED:
            out.append(_LOADED[key])
            continue
        dist = getattr(ep, "dist", None)
        plugin = LoadedPlugin(ep.name, key, "entry point", getattr(dist, "version", None),
                              sha256_of(_module_file(ep.value.split(":")[0].strip())))
        with _importing(plugin) as record:
            target = ep.load()
            if callable(target):
                target()
        plugin.registered = record.names()
        _LOADED[key] = plugin
        out.append(plugin)
    return out


def load_bundled() -> list[LoadedPlugin]:
    """Load the project's own plugins (``bundled.BUNDLED``: SpecTr's verifier, ...), once per process; every tool
    does, whatever ``--no-plugins`` or ``SPEC_EXPLORER_PLUGINS`` say."""
    from .bundled import BUNDLED

    return [load_plugin(module, how="bundled") for module in BUNDLED]


def load_plugins(specs=(), *, use_env: bool = True, entry_points: bool = True) -> list[LoadedPlugin]:
    """Load the project's own plugins (``load_bundled``), then ``specs`` (files or modules), then
    ``SPEC_EXPLORER_PLUGINS``'s (when ``use_env``), then the installed entry points (when ``entry_points``);
    ``SPEC_EXPLORER_PLUGINS=off`` turns the environment's and the entry points off. Returns the plugins loaded by
    this call, the bundled ones first. Raises PluginError at the first plugin that fails."""
    bundled = load_bundled()
    env = os.environ.get(ENV, "").strip() if use_env else ""
    if env.lower() == "off":
        env, entry_points = "", False
    wanted = [*specs, *(s for s in env.split(os.pathsep) if s.strip())]
    out = bundled + [load_plugin(s) for s in wanted]
    if entry_points:
        out += load_entry_points()
    return out


def plugin_args(argv: list[str]) -> tuple[list[str], bool]:
    """The ``--plugin PATH_OR_MODULE`` values (repeatable; ``--plugin=X`` too) and whether ``--no-plugins`` is on a
    command line, read before argparse builds its choices (so that ``--method NAME`` accepts a plugin's method)."""
    specs, off = [], False
    it = iter(range(len(argv)))
    for i in it:
        arg = argv[i]
        if arg == NO_PLUGINS_FLAG:
            off = True
        elif arg == PLUGIN_FLAG and i + 1 < len(argv):
            specs.append(argv[i + 1])
            next(it, None)
        elif arg.startswith(PLUGIN_FLAG + "="):
            specs.append(arg.split("=", 1)[1])
    return specs, off
