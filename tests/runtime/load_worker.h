// One rank of a multi-process load test: `runtime_load_test --rank-worker SCENARIO CKPT CONFIG SOURCE`
// with torchrun's variables set. Prints one JSON line: ok, kind, message, checked, mismatches, skipped.
#pragma once

int LoadWorkerMain(int argc, char** argv);
