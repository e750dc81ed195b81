"""How `msa.registry` takes in plugins, one job per module.

- `faults`: containing a plugin's fault — running plugin code so that anything it raises, short
  of a `KeyboardInterrupt`, becomes a `PluginFault` with a one-line description.
- `records`: validating what a plugin hands msa — its `BackendRecord`s, the backend its factory
  builds, the reasons its checks return.
- `loading`: finding, importing and registering plugins (entry points, `MSA_PLUGINS`,
  `MSA_DISABLE_PLUGINS`, plugins registered in code) and building a backend from its record.

`msa.registry.BackendRegistry` orders and answers queries about what these let through.
"""
