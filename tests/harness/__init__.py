"""What the test suites share, imported as ``tests.harness.<module>`` (nothing here
edits sys.path or imports by file path; pytest puts the repository's root first).

The test host tool (``python -m tests.harness``, stdlib only: `make demo` and the
system tests run it): cli (subcommands), rootfs (debootstrap, cache), apt (the build
machine's apt sources), nspawn (boot, exec, teardown), state (a host's state.json),
procs (/proc, mounts, cgroups), ssh (key, sshd), pipconf (pip configuration), shell
(commands, log, locks).

For the tests: paths (ROOT, FIXTURES), net (free_port), booted (BootedHost, the
system tests' host), endpoint, server (a local `llmhost serve`), load, fuzz, prom
(promtool, a throwaway Prometheus, recordings as a TSDB); soak (`make soak`).
"""
