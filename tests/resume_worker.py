"""Fresh-process half of the resume test: load each checkpoint, train MORE_STEPS, save params.

python tests/resume_worker.py DIR
"""

import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).parent))

from devices import use_device  # noqa: E402
from resume_cases import FIRST_STEPS, all_cases, data, initial_params, train  # noqa: E402

import functional_bagua as fb  # noqa: E402

use_device()  # the test's device (FB_TEST_DEVICE), as in the process that saved
directory = pathlib.Path(sys.argv[1])
batches = data()[FIRST_STEPS:]
for i, (_case_id, make_tx, kind) in enumerate(all_cases()):
    saved = torch.load(directory / f"{i}.pt")
    tx = make_tx()
    state = fb.load_state_dict(tx.init(initial_params(kind)), saved["state"])
    params, _ = train(tx, kind, saved["params"], state, batches)
    torch.save(params, directory / f"{i}.resumed.pt")
print("resumed", len(all_cases()))
