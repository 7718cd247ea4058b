from bench.count_launches import count_launches


def test_launches_of_a_compiled_step_are_counted_by_kind():
    # the vanilla decoder's projections: 7 matmuls a layer forward, 14 backward; the tied head 1 forward, 2 backward
    vanilla, screening = count_launches("d1"), count_launches("multiscreen-d2")
    assert vanilla["matmuls"] == 7 + 14 + 3
    assert vanilla["custom_ops"] == 1  # the training loss's (ppt/kernels/cross_entropy.py)
    assert screening["custom_ops"] == 2 * 2 + 1  # and the screening op forward and backward in each of 2 layers
    assert vanilla["inductor_kernels"] > 0 and screening["inductor_kernels"] > 0
