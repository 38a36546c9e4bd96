"""`python -m sgl_multilora.cluster`: N plugin workers behind SGLang's router (the command line is
sgl_multilora/gateway/cli.py; run it with --help). The only module of this package that imports the live gateway.
"""

import sys

from sgl_multilora.gateway.cli import main

if __name__ == "__main__":
    sys.exit(main())
