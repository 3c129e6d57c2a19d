"""The sizes of each bench mode (``quick``, ``full``, ``device``): ``bench.run`` picks one, a group's own
entry point (``python -m bench.fidelity_bench``) the same."""

SIZES = {
    "quick": {
        "selection_seq_len": 512, "selection_repeats": 9,
        "dump_seq_len": 256, "dump_batch": 2, "dump_steps": 8, "dump_steps_per_file": 2, "dump_repeats": 6,
        "resume_chunks": 10_000, "resume_repeats": 5,
        "train_seq_len": 256, "train_batch": 4, "train_repeats": 7, "loader_batches": 64,
        "verify_steps": 256, "verify_batch": 4, "verify_seq_len": 256, "verify_repeats": 7,
        "kd_docs": 896, "kd_eval_docs": 128, "kd_doc_len": 40, "kd_seq_len": 64, "kd_steps": 200, "kd_top_k": 64,
        "kd_batch": 8,
        # the fidelity group at vocabulary 1024 (every row trained to its plateau, 2,100 to 7,100 steps; evaluating
        # every 50 steps stops 2.5x sooner but short of convergence): the table of docs/BENCHMARKS.md, about 5 CPU-
        # minutes on an AMD EPYC core (20 on the slower Intel Xeon kind); --full: vocabulary 4096, every row
        **{"fid_vocab": 1024, "fid_head_scale": 21.0, "fid_student_layers": 1, "fid_student_width": 64,
           "fid_docs": 2048, "fid_val_docs": 128, "fid_test_docs": 256, "fid_seq_len": 32, "fid_batch": 8,
           "fid_seeds": 3, "fid_lr": 5e-3, "fid_warmup": 100, "fid_eval_every": 100, "fid_patience": 3,
           "fid_tolerance": 5e-3, "fid_decay": 0.25, "fid_decays": 2, "fid_max_steps": 8000,
           "fid_rows": ["ce_only", "full_kd_online", "topk_tail_kl_k64", "sampled_kl_n32", "systematic_kl_n64",
                        "hybrid_kl_k4_n16"]},
        # L=4096: 3 rounds (its per-round spread is +-5%, against +-15% at L=1024)
        "teacher_shapes": [(2, 1024), (1, 4096)], "teacher_repeats": 5, "teacher_repeats_4096": 3,
        "teacher_matmul_n": 2048, "load_repeats": 5, "moe_shape": (2, 1024),
        "chat_conversations": 2000, "chat_repeats": 7, "chat_store_conversations": 64, "chat_store_seq_len": 1024,
    },
    "full": {
        "selection_seq_len": 512, "selection_repeats": 15,
        "dump_seq_len": 512, "dump_batch": 4, "dump_steps": 24, "dump_steps_per_file": 6, "dump_repeats": 7,
        "resume_chunks": 10_000, "resume_repeats": 15,
        "train_seq_len": 512, "train_batch": 8, "train_repeats": 9, "loader_batches": 128,
        "verify_steps": 512, "verify_batch": 4, "verify_seq_len": 512, "verify_repeats": 7,
        "kd_docs": 1536, "kd_eval_docs": 256, "kd_doc_len": 48, "kd_seq_len": 64, "kd_steps": 400, "kd_top_k": 64,
        "kd_batch": 8,
        **{"fid_vocab": 4096, "fid_head_scale": 25.0, "fid_student_layers": 1, "fid_student_width": 64,
           "fid_docs": 2048, "fid_val_docs": 128, "fid_test_docs": 256, "fid_seq_len": 32, "fid_batch": 8,
           "fid_seeds": 3, "fid_lr": 5e-3, "fid_warmup": 100, "fid_eval_every": 100, "fid_patience": 3,
           "fid_tolerance": 5e-3, "fid_decay": 0.25, "fid_decays": 2, "fid_max_steps": 8000, "fid_rows": None},
        "teacher_shapes": [(2, 1024), (1, 4096)], "teacher_repeats": 9, "teacher_matmul_n": 2048,
        "load_repeats": 9, "moe_shape": (2, 1024),
        "chat_conversations": 4000, "chat_repeats": 9, "chat_store_conversations": 128, "chat_store_seq_len": 1024,
    },
    # ``--device``: the teacher group on an accelerator (bench/device_teacher.sh): a 1.7B bfloat16
    # teacher, 8 x 4096 tokens a step, against an 8192^3 bfloat16 matmul
    "device": {
        "teacher_model": "device", "teacher_shapes": [(8, 4096)], "teacher_repeats": 5, "teacher_matmul_n": 8192,
        "load_repeats": 3, "moe_shape": (8, 4096),
    },
}
