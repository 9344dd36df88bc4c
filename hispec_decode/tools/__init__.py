"""Tools built on the library: the ``hispec-generate`` CLI, benchmarks, the policy sweep, the demo."""
