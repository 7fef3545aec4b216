import os
if os.environ.get("HCA_FATAL_STACKS"):
    try:
        import torch
        torch._C._set_print_stack_traces_on_fatal_signal(True)
    except Exception as e:  # noqa
        print("sitecustomize:", e)
