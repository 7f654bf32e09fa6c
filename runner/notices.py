"""Other libraries' notices that a user cannot act on, kept off the console. Training demotes them
to INFO, which its train.log keeps and its console (WARNING and up) does not
(runner.models.torchtune_boundary); serving and export, whose console is their only log, drop
them (runner.deploy.loading). Installed before those libraries are imported."""

from __future__ import annotations

import logging
import warnings

# (logger, the start of its message).
NOTICES = (
    # torchao, which torchtune and peft import, on every machine without Triton (every CPU
    # one): some of its kernels will not work. runner uses none of them.
    ("torchao.kernel.intmm", "Warning: Detected no triton"),
    # bitsandbytes, which peft imports, on a CPU with AVX-512 BF16 and no `kernels` package:
    # it uses its own 4-bit kernel. runner serves no 4-bit model.
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward"),
)


class _Notice(logging.Filter):
    def __init__(self, start: str) -> None:
        super().__init__()
        self.start, self.drop = start, False

    def filter(self, record: logging.LogRecord) -> bool:
        if not record.getMessage().startswith(self.start):
            return True
        record.levelno, record.levelname = logging.INFO, "INFO"
        return not self.drop


def keep_notices_off_the_console(*, drop: bool | None) -> None:
    """Demotes the NOTICES to INFO, or drops them; and silences two uses of names deprecated
    under the libraries that use them, FutureWarnings: peft's of transformers'
    `is_gradient_checkpointing` (at every LoRA checkpoint loaded), and torchtune's and
    torchao's of torch's `all_gather_into_tensor` (QLoRA's NF4 weights gathered for a
    checkpoint, on several processes). Called again, the last call's `drop` holds; None keeps
    an earlier call's (demoting where there was none)."""
    for name, start in NOTICES:
        logger = logging.getLogger(name)
        found = [f for f in logger.filters if isinstance(f, _Notice) and f.start == start]
        notice = found[0] if found else _Notice(start)
        if drop is not None:
            notice.drop = drop
        if not found:
            logger.addFilter(notice)
    for deprecated in ("is_gradient_checkpointing", "torch.distributed.all_gather_into_tensor"):
        warnings.filterwarnings(
            "ignore", message=f"`{deprecated}` is deprecated", category=FutureWarning
        )
