"""One host of a 2-replica Vertex custom job running the dump component (run by test_components):
CLUSTER_SPEC as Vertex sets it, CPU collectives over gloo. Prints the component's outputs if it returns."""

import json
import os
import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")
sys.path.insert(0, sys.argv[1])  # components/ at the repository root

from kfp.dsl import Dataset, Metrics  # noqa: E402

from components.dump_teacher_topk import dump_teacher_topk  # noqa: E402

kwargs, out = json.loads(sys.argv[2]), sys.argv[3]
store, metrics = Dataset(uri=os.path.join(out, "store")), Metrics(uri=os.path.join(out, "metrics"))
result = dump_teacher_topk(store=store, metrics=metrics, **kwargs)
print("OUTPUTS " + json.dumps({"store": store.uri, "metrics": metrics.metadata, "state": result.store_state}),
      flush=True)
