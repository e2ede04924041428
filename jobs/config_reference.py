"""Generate the configuration reference, docs/configuration.md, from the schema (meshtrain.cli.config_reference).

    python jobs/config_reference.py            # print it
    python jobs/config_reference.py --write    # write docs/configuration.md
    python jobs/config_reference.py --check    # exit 1 when docs/configuration.md is stale
"""

import sys

from meshtrain.cli.config_reference import main

if __name__ == "__main__":
    sys.exit(main())
