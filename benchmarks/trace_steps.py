"""Per engine step, where a traced decode batch's time goes (``benchmarks/gpu/trace_steps.py``):

    python benchmarks/trace_steps.py batch_A.trace.json.gz batch_C.trace.json.gz
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: benchmarks.*

from benchmarks.gpu.trace_steps import main  # noqa: E402

if __name__ == "__main__":
    main()
