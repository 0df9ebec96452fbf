"""Stage jobs: `python -m components.jobs <stage> --spec spec.json`."""
