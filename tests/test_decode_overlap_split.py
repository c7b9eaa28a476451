"""`bench decode-overlap --sms`: decode's partition is what a prefill partition leaves, so the
bench takes only those sizes, and says which before it spends a minute loading an engine."""
import pytest

from bullet_trt.protocol import SmSplit
from bullet_trt.tools.bench.decode_overlap import decode_split

H200_SMS = 132
GREEN_PREFILL_SPLITS = list(range(8, H200_SMS - 8 + 1, 8))  # green's offer on 132 SMs: 8..120 step 8


def test_the_whole_gpu_without_sms():
    assert decode_split(H200_SMS, GREEN_PREFILL_SPLITS, None) == SmSplit.whole(H200_SMS)


@pytest.mark.parametrize("decode_sms", [12, 52, 68, 100, 108, 124])
def test_a_size_a_prefill_partition_leaves(decode_sms):
    split = decode_split(H200_SMS, GREEN_PREFILL_SPLITS, decode_sms)
    assert split.sms_of("decode") == decode_sms
    assert split.prefill == H200_SMS - decode_sms


@pytest.mark.parametrize("decode_sms", [64, 66, 96, 132, 4])
def test_any_other_size_is_refused_with_the_sizes_on_offer(decode_sms):
    with pytest.raises(SystemExit) as refused:
        decode_split(H200_SMS, GREEN_PREFILL_SPLITS, decode_sms)
    message = str(refused.value)
    assert f"--sms {decode_sms}" in message
    assert "12..124 step 8" in message
