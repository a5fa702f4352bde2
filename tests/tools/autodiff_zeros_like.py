"""A fresh process for tests/test_bprop.py: what autodiff's zeros_like resolves to after importing the package and after
a GradAccumulationCell compiles, and whether a plain train cell trains bit-identically before and after."""
import os
import sys

import numpy as np
import mindspore as ms
from mindspore import nn
from mindspore.ops.composite.multitype_ops import zeros_like_impl

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from helpers import ce, classification_batches, make_mlp, make_optimizer, params_of, train_steps  # noqa: E402


def plain_run():
    net = make_mlp()
    train_steps(nn.TrainOneStepCell(nn.WithLossCell(net, ce()), make_optimizer("adam", net.trainable_params())),
                classification_batches(3, 32))
    return params_of(net)


def main():
    ms.set_context(mode=ms.GRAPH_MODE)
    if os.environ.get("MS_GRADACCUM_DEVICE"):
        ms.set_context(device_target=os.environ["MS_GRADACCUM_DEVICE"])
    before = plain_run()
    from ms_gradaccum import GradAccumulationCell  # pylint: disable=import-outside-toplevel
    from helpers import ZerosLikeLoss  # pylint: disable=import-outside-toplevel
    print(f"after import: {zeros_like_impl.F.__name__}")
    net = make_mlp()
    step = nn.TrainOneStepCell(GradAccumulationCell(ZerosLikeLoss(net), 4),
                               make_optimizer("sgd", net.trainable_params()))
    train_steps(step, classification_batches(1, 32))
    print(f"after GradAccumulationCell: {zeros_like_impl.F.__name__}")
    after = plain_run()
    same = all(np.array_equal(before[name], after[name]) for name in before)
    print(f"plain before vs after: {'bit-identical' if same else 'DIFFERENT'}")


if __name__ == "__main__":
    main()
