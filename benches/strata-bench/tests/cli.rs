//! The command line as users and scripts see it: JSON keys, exit statuses,
//! one-line errors.

use std::process::{Command, Output};

fn strata(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(args)
        .output()
        .expect("strata runs")
}

fn strata_env(args: &[&str], key: &str, value: &str) -> Output {
    Command::new(env!("CARGO_BIN_EXE_strata"))
        .args(args)
        .env(key, value)
        .output()
        .expect("strata runs")
}

/// A successful run's JSON report.
fn report(out: &Output, json: &std::path::Path) -> serde_json::Value {
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(&std::fs::read_to_string(json).unwrap()).unwrap()
}

/// Exit status 2 and a single stderr line containing `needle`.
fn assert_bad_input(out: &Output, needle: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "stderr: {err}");
    assert_eq!(err.trim_end().lines().count(), 1, "one line, got: {err}");
    assert!(err.contains(needle), "expected {needle:?} in: {err}");
}

#[test]
fn info_json_has_the_documented_keys() {
    let out = strata(&["info", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let nodes = v["numa_nodes"].as_array().unwrap();
    assert!(!nodes.is_empty());
    for n in nodes {
        assert!(n["id"].is_u64() && n["cpus"].is_array() && n["memory_bytes"].is_u64());
        assert!(n["cpu_less"].is_boolean());
    }
    assert!(v["gpu"].is_null() || v["gpu"].is_object());
    // Without a GPU the device tier is the simulated one, and says so.
    if v["gpu"].is_null() {
        assert_eq!(v["backend"], "simulated");
        let dev = v["tiers"]
            .as_array()
            .unwrap()
            .iter()
            .find(|t| t["tier"] == "device")
            .unwrap();
        assert_eq!(dev["emulated"], true);
    }
    assert!(v["io_uring"].is_boolean());
    let tiers = v["tiers"].as_array().unwrap();
    let names: Vec<&str> = tiers.iter().map(|t| t["tier"].as_str().unwrap()).collect();
    assert!(
        names.contains(&"host") && names.contains(&"nvme"),
        "{names:?}"
    );
    for t in tiers {
        assert!(t["capacity_bytes"].as_u64().unwrap() > 0);
        assert!(t["emulated"].is_boolean());
    }
}

#[test]
fn info_reports_an_emulated_cxl_tier_when_asked() {
    let out = strata_env(&["info", "--json"], "STRATA_CXL_MODE", "emulated");
    assert!(out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let cxl = v["tiers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tier"] == "cxl")
        .expect("a cxl tier");
    let has_real = v["numa_nodes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|n| n["cpu_less"] == true);
    assert_eq!(
        cxl["emulated"], true,
        "mode emulated is always emulated (real node: {has_real})"
    );
    let human = strata_env(&["info"], "STRATA_CXL_MODE", "emulated");
    assert!(String::from_utf8_lossy(&human.stdout).contains("[emulated]"));
}

#[test]
fn info_rejects_a_zero_capacity() {
    assert_bad_input(
        &strata_env(&["info"], "STRATA_HOST_CAPACITY", "0"),
        "host capacity",
    );
}

#[test]
fn trace_replay_lines_its_columns_up_for_every_policy() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("t.txt");
    let trace = trace.to_str().unwrap();
    let out = strata(&[
        "trace",
        "gen",
        "--kind",
        "zipf",
        "--pages",
        "64",
        "--accesses",
        "2000",
        "--out",
        trace,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = strata(&[
        "trace",
        "replay",
        "--trace",
        trace,
        "--capacity-pages",
        "16",
        "--policy",
        "all",
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    let table: Vec<&str> = text
        .lines()
        .skip_while(|l| !l.starts_with("policy"))
        .collect();
    assert!(table.len() > 10, "a row per policy: {text}");
    // Every row's hit count ends where the header's "hits" does.
    let end = table[0].find("hits").unwrap() + "hits".len();
    for row in &table[1..] {
        let hits = row.split_whitespace().nth(1).unwrap();
        let at = row.find(&format!(" {hits} ")).unwrap() + 1 + hits.len();
        assert_eq!(at, end, "misaligned row {row:?} under {:?}", table[0]);
    }
}

#[test]
fn bench_io_reports_fio_style_json() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.json");
    for pattern in ["randread", "write"] {
        let out = strata(&[
            "bench",
            "io",
            "--path",
            dir.path().to_str().unwrap(),
            "--size",
            "8M",
            "--pattern",
            pattern,
            "--bs",
            "4k",
            "--qd",
            "4",
            "--seconds",
            "0.3",
            "--json",
            json.to_str().unwrap(),
        ]);
        let v = report(&out, &json);
        assert_eq!(v["pattern"], pattern);
        assert_eq!(v["bs"], 4096);
        assert_eq!(v["qd"], 4);
        assert!(v["engine"] == "uring" || v["engine"] == "psync");
        assert!(v["iops"].as_f64().unwrap() > 0.0);
        let bw = v["bytes_per_sec"].as_f64().unwrap();
        assert!((bw - v["iops"].as_f64().unwrap() * 4096.0).abs() < 1.0);
    }
    // The private swap file never shows in the directory.
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1);
}

#[test]
fn bench_copy_reports_cases_beside_memcpy() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("c.json");
    let out = strata(&[
        "bench",
        "copy",
        "--size",
        "4M",
        "--page-sizes",
        "64k",
        "--rounds",
        "1",
        "--emulate-cxl",
        "--json",
        json.to_str().unwrap(),
    ]);
    let v = report(&out, &json);
    assert_eq!(v["cxl"], "emulated");
    let cases = v["cases"].as_array().unwrap();
    let links: Vec<&str> = cases.iter().map(|c| c["link"].as_str().unwrap()).collect();
    assert_eq!(links, ["dram->dram", "dram->cxl", "cxl->dram"]);
    for c in cases {
        assert_eq!(c["page_size"], 65536);
        assert!(c["bytes_per_sec"].as_f64().unwrap() > 0.0);
        assert!(c["memcpy_bytes_per_sec"].as_f64().unwrap() > 0.0);
    }
    assert!(String::from_utf8_lossy(&out.stdout).contains("emulated"));
}

#[test]
fn bench_io_bad_input_is_one_line_and_status_2() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let io = |extra: &[&str]| {
        let mut args = vec!["bench", "io", "--seconds", "0.1"];
        args.extend_from_slice(extra);
        strata(&args)
    };
    assert_bad_input(
        &io(&["--path", "/nonexistent-strata-dir/f", "--size", "1M"]),
        "does not exist",
    );
    assert_bad_input(
        &io(&["--path", d, "--size", "10000", "--bs", "4k"]),
        "not a multiple",
    );
    // The OS's error by its name, without Rust's "(os error 13)" tail.
    let out = io(&["--path", "/sys/strata-cannot-be-here", "--size", "1M"]);
    assert_bad_input(&out, "Permission denied");
    assert!(
        !String::from_utf8_lossy(&out.stderr).contains("os error"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_bad_input(&io(&["--path", d, "--size", "0"]), "zero");
    assert_bad_input(
        &io(&["--path", d, "--size", "1M", "--bs", "3k"]),
        "power of two",
    );
    assert_bad_input(
        &io(&["--path", d, "--size", "1M", "--bs", "4M"]),
        "outside 4K..2M",
    );
    assert_bad_input(
        &io(&["--path", d, "--size", "1M", "--pattern", "sideways"]),
        "unknown pattern",
    );
    assert_bad_input(
        &io(&["--path", d, "--size", "1M", "--engine", "aio"]),
        "unknown io engine",
    );
    assert_bad_input(&io(&["--path", d, "--size", "12Q"]), "unknown suffix");
    assert_bad_input(&io(&["--path", d, "--size", "1M", "--qd", "0"]), "--qd");
    let existing = dir.path().join("keep");
    std::fs::write(&existing, b"precious").unwrap();
    assert_bad_input(
        &io(&["--path", existing.to_str().unwrap(), "--size", "1M"]),
        "will not overwrite",
    );
    assert_eq!(std::fs::read(&existing).unwrap(), b"precious");
}

/// A filesystem without O_DIRECT (ramfs; tmpfs has it since Linux 6.6):
/// exit 2 naming O_DIRECT, and nothing left behind.
#[test]
fn bench_io_without_o_direct_names_it_and_leaves_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mnt = dir.path();
    let mounted = Command::new("mount")
        .args(["-t", "ramfs", "ramfs"])
        .arg(mnt)
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !mounted {
        if std::env::var_os("STRATA_REQUIRE_RAMFS").is_some() {
            panic!("STRATA_REQUIRE_RAMFS is set but a ramfs cannot be mounted here");
        }
        eprintln!("skipping: cannot mount a ramfs here (needs root); the O_DIRECT error mapping is unit-tested in tier::nvme");
        return;
    }
    let file = mnt.join("swap");
    let r1 = strata(&[
        "bench",
        "io",
        "--path",
        mnt.to_str().unwrap(),
        "--size",
        "1M",
        "--seconds",
        "0.1",
    ]);
    let r2 = strata(&[
        "bench",
        "io",
        "--path",
        file.to_str().unwrap(),
        "--size",
        "1M",
        "--seconds",
        "0.1",
    ]);
    let leftovers = std::fs::read_dir(mnt).unwrap().count();
    let _ = Command::new("umount").arg(mnt).status();
    assert_bad_input(&r1, "O_DIRECT");
    assert_bad_input(&r2, "O_DIRECT");
    assert_eq!(leftovers, 0, "a refused swap file was left behind");
}

#[test]
fn bench_io_rejects_absurd_durations_and_depths_before_running() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let io = |extra: &[&str]| {
        let mut args = vec!["bench", "io", "--path", d];
        args.extend_from_slice(extra);
        strata(&args)
    };
    assert_bad_input(&io(&["--size", "1M", "--seconds", "1e20"]), "--seconds");
    // A huge positive number is told the limit, not that it is negative.
    assert_bad_input(
        &io(&["--size", "1M", "--seconds", "1e30"]),
        "at most a week",
    );
    assert_bad_input(&io(&["--size", "1M", "--seconds=-1"]), "--seconds");
    assert_bad_input(
        &io(&[
            "--size",
            "4M",
            "--bs",
            "2M",
            "--qd",
            "4096",
            "--seconds",
            "0.1",
        ]),
        "1 GiB",
    );
    // A --json path that cannot be written fails before the run.
    assert_bad_input(
        &io(&[
            "--size",
            "1M",
            "--seconds",
            "5",
            "--json",
            "/nonexistent-strata-dir/r.json",
        ]),
        "--json",
    );
    // A depth above the number of blocks runs at the number of blocks.
    let json = dir.path().join("r.json");
    let out = io(&[
        "--size",
        "16k",
        "--qd",
        "64",
        "--seconds",
        "0.2",
        "--json",
        json.to_str().unwrap(),
    ]);
    let v = report(&out, &json);
    // 4 blocks, one of which the store keeps in reserve for
    // copy-then-commit writes.
    assert_eq!(v["qd"], 3);
}

#[test]
fn unknown_subcommand_is_status_2() {
    let out = strata(&["frobnicate"]);
    assert_eq!(out.status.code(), Some(2));
}

#[test]
fn bench_migrate_reports_every_link() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("m.json");
    let out = strata(&[
        "bench",
        "migrate",
        "--device",
        "sim",
        "--page-sizes",
        "64k",
        "--size",
        "1M",
        "--path",
        dir.path().to_str().unwrap(),
        "--json",
        json.to_str().unwrap(),
    ]);
    let v = report(&out, &json);
    assert_eq!(v["backend"], "simulated");
    let cases = v["cases"].as_array().unwrap();
    let links: Vec<&str> = cases.iter().map(|c| c["link"].as_str().unwrap()).collect();
    assert_eq!(
        links,
        [
            "host->device",
            "device->host",
            "host->cxl",
            "cxl->host",
            "host->nvme",
            "nvme->host"
        ]
    );
    for c in cases {
        assert_eq!(c["page_size"], 65536);
        assert!(c["bytes_per_sec"].as_f64().unwrap() > 0.0);
        assert!(c["raw_bytes_per_sec"].as_f64().unwrap() > 0.0);
    }
    assert_bad_input(
        &strata(&["bench", "migrate", "--device", "tpu"]),
        "unknown device",
    );
}

#[test]
fn bench_graph_runs_a_baseline_once_where_its_trials_would_repeat() {
    // PageRank has no source and --source fixes BFS's: a baseline's
    // modelled run would repeat, so it runs once; strata runs every trial
    // (its rounds follow measured time). Random sources: every trial.
    let dir = tempfile::tempdir().unwrap();
    let trials = |extra: &[&str]| {
        let json = dir.path().join("t.json");
        let mut args = vec![
            "bench",
            "graph",
            "--graph",
            "kron:10",
            "--baselines",
            "--verify",
            "--trials",
            "3",
            "--page-size",
            "4k",
            "--quiet",
            "--json",
            json.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let r = report(&strata(&args), &json);
        r["results"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| {
                let t = c["trials"].as_array().unwrap();
                assert!(t.iter().all(|t| t["verified"] == true), "{c}");
                (c["config"].as_str().unwrap().to_string(), t.len())
            })
            .collect::<Vec<_>>()
    };
    let once = |v: Vec<(String, usize)>| {
        for (config, n) in v {
            assert_eq!(n, if config == "strata" { 3 } else { 1 }, "{config}");
        }
    };
    once(trials(&["--algo", "pr"]));
    once(trials(&["--algo", "bfs", "--source", "3"]));
    for (config, n) in trials(&["--algo", "bfs"]) {
        assert_eq!(n, 3, "{config}: a random source per trial");
    }
}

#[test]
fn bench_graph_warm_trials_start_where_the_last_left_off() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("w.json");
    let r = report(
        &strata(&[
            "bench",
            "graph",
            "--graph",
            "kron:10",
            "--algo",
            "pr",
            "--configs",
            "strata,all-device,zero-copy",
            "--device-budget",
            "25%",
            "--verify",
            "--warm",
            "--trials",
            "3",
            "--page-size",
            "4k",
            "--quiet",
            "--json",
            json.to_str().unwrap(),
        ]),
        &json,
    );
    assert_eq!(r["params"]["warm"], true);
    let results = r["results"].as_array().unwrap();
    let of = |name: &str| results.iter().find(|c| c["config"] == name).unwrap();
    for c in results {
        let t = c["trials"].as_array().unwrap();
        // Every trial runs (none repeats the one before), the first cold.
        assert_eq!(t.len(), 3, "{c}");
        assert_eq!(t[0]["cold"], true, "{c}");
        assert!(t[1..].iter().all(|t| t.get("cold").is_none()), "{c}");
        assert!(t.iter().all(|t| t["verified"] == true), "{c}");
        // The medians are the warm trials'; the cold one is apart.
        assert_eq!(c["cold_seconds"], t[0]["seconds"], "{c}");
        let mut warm: Vec<f64> = t[1..]
            .iter()
            .map(|t| t["seconds"].as_f64().unwrap())
            .collect();
        warm.sort_by(f64::total_cmp);
        let median = c["seconds"].as_f64().unwrap();
        assert!(median >= warm[0] && median <= warm[1], "{c}");
    }
    // all-device uploads the graph once.
    let d = of("all-device")["trials"].as_array().unwrap().clone();
    assert!(d[0]["bytes_moved"].as_u64().unwrap() > 0);
    assert!(d[1..]
        .iter()
        .all(|t| t["bytes_moved"] == 0 && t["cost"]["upload"] == 0.0));
    // Unified Memory keeps what it holds: where the graph fits, the warm
    // trial faults nothing in.
    let json = dir.path().join("u.json");
    let r = report(
        &strata(&[
            "bench",
            "graph",
            "--graph",
            "kron:16",
            "--algo",
            "pr",
            "--configs",
            "uvm",
            "--device-budget",
            "100%",
            "--warm",
            "--trials",
            "2",
            "--quiet",
            "--json",
            json.to_str().unwrap(),
        ]),
        &json,
    );
    let u = r["results"][0]["trials"].as_array().unwrap().clone();
    assert!(u[0]["bytes_moved"].as_u64().unwrap() > 0, "{u:?}");
    assert_eq!(u[1]["bytes_moved"], 0, "{u:?}");
    assert_eq!(u[1]["cost"]["detail"]["uvm"]["faults"], 0, "{u:?}");
    // One trial is no warm run.
    assert_bad_input(
        &strata(&[
            "bench", "graph", "--graph", "kron:8", "--warm", "--trials", "1",
        ]),
        "--warm needs --trials 2",
    );
}

#[test]
fn bench_graph_compares_the_configurations_and_verifies() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("g.json");
    let dump = dir.path().join("g.dump");
    let svg = dir.path().join("g.svg");
    let out = strata(&[
        "bench",
        "graph",
        "--algo",
        "bfs",
        "--graph",
        "kron:10",
        "--baselines",
        "--verify",
        "--trials",
        "2",
        "--source",
        "3",
        "--page-size",
        "4k",
        "--quiet",
        "--json",
        json.to_str().unwrap(),
        "--dump",
        dump.to_str().unwrap(),
        "--plot",
        svg.to_str().unwrap(),
    ]);
    let r = report(&out, &json);
    assert_eq!(r["backend"], "simulated");
    let configs: Vec<&str> = r["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["config"].as_str().unwrap())
        .collect();
    assert_eq!(
        configs,
        [
            "strata",
            "uvm",
            "uvm-advised",
            "zero-copy",
            "all-device",
            "static-optimum"
        ]
    );
    assert_eq!(r["model"]["name"], "h200-sxm5");
    for c in r["results"].as_array().unwrap() {
        for key in ["seconds", "teps", "bytes_moved", "hit_rate"] {
            assert!(c[key].is_number(), "{key} in {c}");
        }
        assert!(c["trials"]
            .as_array()
            .unwrap()
            .iter()
            .all(|t| t["verified"] == true));
    }
    assert_eq!(r["params"]["graph"]["kind"], "kron");
    // One `vertex depth` line per vertex; the source at depth 0.
    let text = std::fs::read_to_string(&dump).unwrap();
    assert_eq!(text.lines().count(), 1024);
    assert!(text.lines().any(|l| l == "3 0"));
    assert!(std::fs::read_to_string(&svg).unwrap().contains("<svg"));
}

#[test]
fn bench_graph_reads_edge_lists_and_names_bad_lines() {
    let dir = tempfile::tempdir().unwrap();
    let el = dir.path().join("g.wel");
    std::fs::write(&el, "# a comment\n0 1 5\n1 2 7\n2 0 1\n3 2 4\n").unwrap();
    let json = dir.path().join("g.json");
    let graph = format!("file:{}", el.display());
    for algo in ["bfs", "sssp", "pr", "cc"] {
        // A source is BFS's and SSSP's (refused for the others).
        let source: &[&str] = if matches!(algo, "bfs" | "sssp") {
            &["--source", "0"]
        } else {
            &[]
        };
        let out = strata(
            &[
                &["bench", "graph", "--algo", algo, "--graph", &graph][..],
                source,
                &[
                    "--device-budget",
                    "50%",
                    "--page-size",
                    "4k",
                    "--trials",
                    "1",
                    "--verify",
                    "--quiet",
                    "--json",
                    json.to_str().unwrap(),
                ][..],
            ]
            .concat(),
        );
        let r = report(&out, &json);
        assert_eq!(r["vertices"], 4, "{algo}");
    }
    for (text, says) in [
        ("1 1 5\n", "no edge"),
        ("0 1 5\n1 3000000000 2\n", "vertex id above"),
        ("0 1 0\n", "weight"),
    ] {
        std::fs::write(&el, text).unwrap();
        assert_bad_input(
            &strata(&["bench", "graph", "--graph", &graph, "--quiet"]),
            says,
        );
    }
    std::fs::write(&el, "0 1 5\n1 two 7\n").unwrap();
    assert_bad_input(
        &strata(&["bench", "graph", "--graph", &graph, "--quiet"]),
        "line 2",
    );
    assert_bad_input(
        &strata(&["bench", "graph", "--algo", "dfs", "--quiet"]),
        "unknown algorithm",
    );
    assert_bad_input(
        &strata(&["bench", "graph", "--device-budget", "150%", "--quiet"]),
        "device budget",
    );
    assert_bad_input(
        &strata(&[
            "bench", "graph", "--graph", "kron:8", "--source", "999", "--quiet",
        ]),
        "source 999",
    );
    assert_bad_input(
        &strata(&[
            "bench", "graph", "--graph", "kron:8", "--algo", "pr,cc", "--source", "3", "--quiet",
        ]),
        "--source is BFS's and SSSP's",
    );
    assert_bad_input(
        &strata(&["bench", "graph", "--graph", "grid:4", "--quiet"]),
        "graph",
    );
    assert_bad_input(
        &strata(&["bench", "graph", "--device", "gpu", "--quiet"]),
        "unknown device",
    );
    // Asking for a GPU where there is none (or a build without cuda) is
    // bad input too.
    if strata::device::probe_gpus().is_err() {
        assert_bad_input(
            &strata(&["bench", "graph", "--device", "cuda", "--quiet"]),
            "--device cuda",
        );
    }
}

#[test]
fn bench_recsys_charges_strata_moves_on_the_presets_link() {
    // The same moves of strata's page placement (the run is
    // deterministic) cost what each preset's DMA engine takes: H200's PCIe
    // Gen5 moves the bytes about twice as fast as A100's Gen4, so the
    // migrations' share differs between them. strata's row cache moves
    // nothing between batches: its fills are its misses' own reads.
    let dir = tempfile::tempdir().unwrap();
    let run = |platform: &str| {
        let json = dir.path().join(format!("{platform}.json"));
        let out = strata(&[
            "bench",
            "recsys",
            "--tables",
            "2",
            "--rows",
            "8192",
            "--dim",
            "64",
            "--pooling",
            "8",
            "--batch",
            "128",
            "--batches",
            "6",
            "--platform",
            platform,
            "--baselines",
            "--quiet",
            "--json",
            json.to_str().unwrap(),
        ]);
        let r = report(&out, &json);
        let rows = &r["results"][0];
        assert_eq!(rows["config"], "strata");
        assert_eq!(rows["migration_seconds"], 0.0, "{rows}");
        let s = &r["results"][1];
        assert_eq!(s["config"], "strata-pages");
        (
            s["bytes_moved"].as_u64().unwrap(),
            s["migration_seconds"].as_f64().unwrap(),
            s["seconds"].as_f64().unwrap(),
        )
    };
    let (h_bytes, h_mig, h_all) = run("h200-sxm5");
    let (a_bytes, a_mig, a_all) = run("a100-pcie4");
    assert_eq!(h_bytes, a_bytes, "the same moves");
    assert!(h_bytes > 0 && h_mig > 0.0 && h_mig < h_all && a_mig < a_all);
    let ratio = a_mig / h_mig;
    assert!(
        (1.2..=2.2).contains(&ratio),
        "A100's migrations {a_mig} s over H200's {h_mig} s: {ratio}"
    );
}

#[test]
fn bench_recsys_caps_a_device_budget_above_the_tables_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.json");
    let run = |budget: &str| {
        strata(&[
            "bench",
            "recsys",
            "--tables",
            "2",
            "--rows",
            "1024",
            "--dim",
            "16",
            "--pooling",
            "4",
            "--batch",
            "16",
            "--batches",
            "2",
            "--page-size",
            "4k",
            "--device-budget",
            budget,
            "--quiet",
            "--json",
            json.to_str().unwrap(),
        ])
    };
    // 2 × 1024 rows × 64 bytes: 128 KiB of tables.
    let out = run("1G");
    let r = report(&out, &json);
    assert_eq!(r["budget_bytes"], 128 << 10);
    assert_eq!(r["budget_requested"], 1u64 << 30);
    assert!(
        String::from_utf8_lossy(&out.stdout)
            .contains("--device-budget 1G is more than the tables need: capped to 128K"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let out = run("64k");
    let r = report(&out, &json);
    assert_eq!(r["budget_bytes"], 64 << 10);
    assert!(r.get("budget_requested").is_none(), "{r}");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("capped"));
}

#[test]
fn bench_recsys_compares_the_configurations() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("r.json");
    let out = strata(&[
        "bench",
        "recsys",
        "--tables",
        "2",
        "--rows",
        "4096",
        "--dim",
        "16",
        "--pooling",
        "4",
        "--batch",
        "64",
        "--batches",
        "9",
        "--page-size",
        "4k",
        "--baselines",
        "--quiet",
        "--json",
        json.to_str().unwrap(),
    ]);
    let r = report(&out, &json);
    assert_eq!(r["backend"], "simulated");
    let configs: Vec<&str> = r["results"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["config"].as_str().unwrap())
        .collect();
    assert_eq!(
        configs,
        [
            "strata",
            "strata-pages",
            "lru-cache",
            "zero-copy",
            "all-device"
        ]
    );
    // The page placement's promotions, settled: (paid, not paid); none for
    // the others.
    let paid = &r["results"][1]["promotions_paid"];
    let (p, u) = (paid[0].as_u64().unwrap(), paid[1].as_u64().unwrap());
    assert!(p > 0, "hot pages promoted are read again: {paid} ({u} not)");
    assert!(r["results"][0]["promotions_paid"].is_null());
    assert!(r["results"][2]["promotions_paid"].is_null());
    // strata's row cache: hot rows served from device memory, every byte
    // it moved a missed row's own read (16 floats a row).
    let rows = &r["results"][0];
    let hit = rows["hit_rate"].as_f64().unwrap();
    let lookups = r["lookups"].as_f64().unwrap();
    let moved = rows["bytes_moved"].as_f64().unwrap();
    assert!(hit > 0.2, "{rows}");
    assert!(
        moved > 0.0 && moved <= (1.0 - hit) * lookups * 64.0 + 0.5,
        "{rows}"
    );
    for c in r["results"].as_array().unwrap() {
        for key in ["lookups_per_sec", "hit_rate", "bytes_moved", "seconds"] {
            assert!(c[key].is_number(), "{key} in {c}");
        }
        // Batches 0 and 8 checked against the direct sums.
        assert_eq!(c["verified_batches"], 2, "{c}");
    }
    // The best fixed placements: by rows, then by pages; rows are finer, so
    // they serve at least as many lookups from the same bytes.
    let opt = r["static_optimum"].as_array().unwrap();
    assert_eq!(opt[0]["granularity"], "rows");
    assert_eq!(opt[1]["granularity"], "pages");
    let hit = |o: &serde_json::Value| o["hit_rate"].as_f64().unwrap();
    assert!(hit(&opt[0]) >= hit(&opt[1]), "{opt:?}");
    assert!(
        hit(&opt[1]) > 0.0 && hit(&opt[1]) < 1.0 && hit(&opt[0]) <= 1.0,
        "{opt:?}"
    );
    let idx = dir.path().join("idx");
    std::fs::write(&idx, "0:1 0:2 1:5\n0:3 1:x\n").unwrap();
    assert_bad_input(
        &strata(&[
            "bench",
            "recsys",
            "--tables",
            "2",
            "--rows",
            "16",
            "--dim",
            "16",
            "--page-size",
            "4k",
            "--dist",
            &format!("file:{}", idx.display()),
            "--quiet",
        ]),
        "line 2",
    );
    assert_bad_input(
        &strata(&["bench", "recsys", "--dist", "zipf:x", "--quiet"]),
        "--dist",
    );
    assert_bad_input(
        &strata(&["bench", "recsys", "--dim", "3", "--quiet"]),
        "divide the page size",
    );
}

#[test]
fn bench_moe_compares_the_configurations() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("moe.json");
    let out = strata(&[
        "bench",
        "moe",
        "--layers",
        "4",
        "--experts",
        "16",
        "--top-k",
        "2",
        "--expert-bytes",
        "64k",
        "--tokens",
        "64",
        "--baselines",
        "--quiet",
        "--json",
        json.to_str().unwrap(),
    ]);
    let v = report(&out, &json);
    assert_eq!(v["backend"], "simulated");
    assert_eq!(v["modelled"], true);
    assert_eq!(v["device_slots"], 16);
    let results = v["results"].as_array().unwrap();
    let names: Vec<&str> = results
        .iter()
        .map(|r| r["config"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["strata", "lru", "no-cache"]);
    for r in results {
        for k in ["hit_rate", "stall_seconds", "prefetch_accuracy"] {
            assert!(r[k].as_f64().unwrap() >= 0.0, "{k}");
        }
        assert!(r["bytes_moved"].as_u64().unwrap() > 0);
        assert!(r["verified_fetches"].as_u64().unwrap() > 0);
    }
    assert_eq!(results[2]["hit_rate"], 0.0);
}

#[test]
fn bench_moe_reads_a_routing_trace() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("routes.txt");
    let mut text = String::from("# token layer expert\n");
    for t in 0..40 {
        for l in 0..3 {
            text += &format!("{t} {l} {}\n{t} {l} {}\n", t % 5, 5 + (t + l) % 3);
        }
    }
    std::fs::write(&trace, text).unwrap();
    let json = dir.path().join("moe.json");
    let routing = format!("file:{}", trace.display());
    let out = strata(&[
        "bench",
        "moe",
        "--routing",
        &routing,
        "--expert-bytes",
        "64k",
        "--quiet",
        "--json",
        json.to_str().unwrap(),
    ]);
    let v = report(&out, &json);
    assert_eq!(
        (v["layers"].as_u64(), v["experts"].as_u64()),
        (Some(3), Some(8))
    );
    assert_eq!(v["tokens"], 40);
    // A measured link and compute in place of the platform's: the bounds
    // take them (a transfer of 64 KiB at 0.5 GB/s plus 10 µs).
    let out = strata(&[
        "bench",
        "moe",
        "--routing",
        &routing,
        "--expert-bytes",
        "64k",
        "--link-gbps",
        "0.5",
        "--link-latency-us",
        "10",
        "--layer-compute-us",
        "200",
        "--quiet",
        "--json",
        json.to_str().unwrap(),
    ]);
    let w = report(&out, &json);
    let transfer = w["bounds"]["transfer_seconds"].as_f64().unwrap();
    assert!(
        (transfer - (65536.0 / 0.5e9 + 10e-6)).abs() < 1e-7,
        "{transfer}"
    );
    assert!((w["layer_compute_seconds"].as_f64().unwrap() - 200e-6).abs() < 1e-12);
    assert!(
        w["bounds"]["belady_stall_seconds"].as_f64() > v["bounds"]["belady_stall_seconds"].as_f64()
    );
    std::fs::write(&trace, "0 0 1\n0 zero 2\n").unwrap();
    let err = format!("{}:2", trace.display());
    assert_bad_input(
        &strata(&["bench", "moe", "--routing", &routing, "--quiet"]),
        &err,
    );
}

#[test]
fn bench_moe_prefetches_what_the_trace_records() {
    // strata.moe writes the lookahead it made beside the routing
    // (`token layer expert prefetched`): the bench's strata prefetches
    // exactly that instead of its predictor, unless --predictor.
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("routes.txt");
    let json = dir.path().join("moe.json");
    let routed = |t: usize, l: usize| [t % 3, 3 + (t + l) % 3];
    let run = |guess: &dyn Fn(usize, usize) -> Vec<usize>, extra: &[&str]| {
        let mut text = String::new();
        for t in 0..60 {
            for l in 0..3 {
                if l + 1 < 3 {
                    for e in guess(t, l + 1) {
                        text += &format!("{t} {} {e} prefetched\n", l + 1);
                    }
                }
                for e in routed(t, l) {
                    text += &format!("{t} {l} {e}\n");
                }
            }
        }
        std::fs::write(&trace, text).unwrap();
        let routing = format!("file:{}", trace.display());
        let mut args = vec![
            "bench",
            "moe",
            "--routing",
            &routing,
            "--experts",
            "8",
            "--expert-bytes",
            "64k",
            "--device-slots",
            "4",
            "--quiet",
            "--json",
            json.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let v = report(&strata(&args), &json);
        let s = v["results"][0].clone();
        assert_eq!(s["config"], "strata");
        (v["lookahead"].as_str().unwrap().to_string(), s)
    };
    let (how, right) = run(&|t, l| routed(t, l).to_vec(), &[]);
    assert_eq!(how, "recorded");
    let (_, wrong) = run(&|_, _| vec![7], &[]);
    let accuracy = |s: &serde_json::Value| s["prefetch_accuracy"].as_f64().unwrap();
    assert!(right["prefetches"].as_u64().unwrap() > 0, "{right}");
    assert_eq!(accuracy(&wrong), 0.0, "expert 7 is never routed: {wrong}");
    assert!(accuracy(&right) > 0.5, "{right}");
    let (how, _) = run(&|_, _| vec![7], &["--predictor"]);
    assert_eq!(how, "predictor");
    // The library's protection of a prefetch (twice the router's top-k)
    // in place of the trace's widest layer: the right guesses still land.
    let (_, protected) = run(&|t, l| routed(t, l).to_vec(), &["--protect-fetches", "2"]);
    assert!(accuracy(&protected) > 0.5, "{protected}");
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["params"]["protect_fetches"], 2);
}

#[test]
fn bench_moe_and_optim_reject_bad_input() {
    assert_bad_input(
        &strata(&["bench", "moe", "--routing", "zipf:x", "--quiet"]),
        "zipf:",
    );
    assert_bad_input(
        &strata(&["bench", "moe", "--top-k", "0", "--quiet"]),
        "top-k",
    );
    assert_bad_input(
        &strata(&["bench", "optim", "--tier", "tape", "--quiet"]),
        "--tier",
    );
    assert_bad_input(
        &strata(&["bench", "optim", "--chunk", "3k", "--quiet"]),
        "--chunk",
    );
    assert_bad_input(
        &strata(&["bench", "optim", "--update", "gpu", "--quiet"]),
        "--update",
    );
    assert_bad_input(
        &strata(&["bench", "optim", "--dtype", "f64", "--quiet"]),
        "--dtype",
    );
    assert_bad_input(
        &strata(&["bench", "moe", "--device", "gpu", "--quiet"]),
        "--device",
    );
    assert_bad_input(
        &strata(&["bench", "moe", "--host-experts", "0", "--quiet"]),
        "--host-experts 0",
    );
    // A bad --tier is the fault, not the --path given with it.
    assert_bad_input(
        &strata(&["bench", "optim", "--tier", "NVME", "--path", ".", "--quiet"]),
        "--tier \"NVME\"",
    );
    assert_bad_input(
        &strata(&["bench", "moe", "--link-gbps", "0", "--quiet"]),
        "--link-gbps",
    );
    assert_bad_input(
        &strata(&["bench", "moe", "--layer-compute-us", "-1", "--quiet"]),
        "--layer-compute-us",
    );
    // A host tier of every expert leaves none on NVMe.
    assert_bad_input(
        &strata(&[
            "bench",
            "moe",
            "--layers",
            "2",
            "--experts",
            "8",
            "--top-k",
            "2",
            "--device-slots",
            "4",
            "--host-experts",
            "16",
            "--quiet",
        ]),
        "--host-experts",
    );
    assert_bad_input(
        &strata(&["bench", "moe", "--path", ".", "--quiet"]),
        "--host-experts",
    );
    assert_bad_input(
        &strata(&[
            "bench",
            "moe",
            "--host-experts",
            "4",
            "--nvme-gbps",
            "0",
            "--quiet",
        ]),
        "--nvme-gbps",
    );
}

#[test]
fn bench_moe_device_cuda_runs_on_a_gpu_or_says_there_is_none() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("moe.json");
    let out = strata(&[
        "bench",
        "moe",
        "--device",
        "cuda",
        "--layers",
        "2",
        "--experts",
        "8",
        "--tokens",
        "8",
        "--expert-bytes",
        "64k",
        "--quiet",
        "--json",
        json.to_str().unwrap(),
    ]);
    if out.status.success() {
        let v = report(&out, &json);
        assert_eq!(
            (v["backend"].as_str(), v["modelled"].as_bool()),
            (Some("cuda"), Some(false))
        );
    } else {
        assert_eq!(out.status.code(), Some(2));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.starts_with("strata: --device cuda: "), "{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    }
}

#[test]
fn bench_optim_update_cuda_runs_on_a_gpu_or_says_there_is_none() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("optim.json");
    let out = strata(&[
        "bench",
        "optim",
        "--params",
        "2000",
        "--chunk",
        "4k",
        "--steps",
        "1",
        "--update",
        "cuda",
        "--quiet",
        "--json",
        json.to_str().unwrap(),
    ]);
    // It runs exactly where there is a GPU, on the CUDA updater (never a
    // silent fallback to the CPU's).
    let gpu = strata::device::probe_gpus().is_ok();
    assert_eq!(out.status.success(), gpu, "{out:?}");
    if gpu {
        let v = report(&out, &json);
        assert_eq!(v["backend"].as_str(), Some("cuda"), "{v}");
    } else {
        // No GPU here: one line naming it, exit status 2 (as for every
        // command asked for a device the machine does not have).
        assert_eq!(out.status.code(), Some(2));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("no CUDA device"), "{err}");
        assert_eq!(err.trim_end().lines().count(), 1, "{err}");
    }
}

#[test]
fn bench_optim_reports_throughput_beside_the_limits() {
    let dir = tempfile::tempdir().unwrap();
    for (tier, shared) in [
        ("host", false),
        ("nvme", false),
        ("host", true),
        ("nvme", true),
    ] {
        let json = dir.path().join(format!("{tier}-{shared}.json"));
        let mut args = vec![
            "bench",
            "optim",
            "--params",
            "200000",
            "--chunk",
            "64k",
            "--tier",
            tier,
            "--steps",
            "2",
            "--quiet",
            "--json",
            json.to_str().unwrap(),
        ];
        if tier == "nvme" {
            args.extend(["--path", dir.path().to_str().unwrap()]);
        }
        if shared {
            args.push("--shared");
        }
        let out = strata(&args);
        let v = report(&out, &json);
        assert_eq!(v["params"]["shared"], shared);
        assert_eq!(v["tier"], tier);
        assert_eq!(v["backend"], "cpu");
        assert_eq!(v["params"]["update"], "cpu");
        for k in [
            "step_seconds",
            "bytes_per_sec",
            "memcpy_bytes_per_sec",
            "ratio_to_memcpy",
        ] {
            assert!(v[k].as_f64().unwrap() > 0.0, "{k}");
        }
        assert!(v["io_wait_seconds"].as_f64().unwrap() >= 0.0);
        for k in [
            "nvme_seq_read_bytes_per_sec",
            "nvme_seq_write_bytes_per_sec",
            "nvme_bound_seconds",
            "nvme_fraction",
        ] {
            assert_eq!(v[k].is_f64(), tier == "nvme", "{k}");
        }
        if tier == "nvme" {
            // The bound: the step's state read and written at the disk's rates.
            let per = |k: &str| v[k].as_f64().unwrap();
            let bound = per("nvme_bound_seconds");
            let steps = per("state_bytes_per_step");
            assert!(bound > steps / 2.0 / per("nvme_seq_read_bytes_per_sec") * 0.999);
            assert!(
                (per("nvme_fraction") - bound / per("step_seconds")).abs()
                    < 1e-9 * per("nvme_fraction").max(1.0)
            );
        }
        // A plain fp32 step is aliased (the parameter is its own master):
        // it reads and writes the two moments, two thirds of the state.
        let state = v["state_bytes"].as_f64().unwrap();
        assert_eq!(
            v["state_bytes_per_step"].as_f64().unwrap(),
            2.0 * state * 2.0 / 3.0
        );
    }
    // bf16 parameters with the roofline: the triad beside the step, 28
    // bytes a parameter to move (fp32 in the host tier: its own master, 28).
    for (dtype, name, moved) in [("bf16", "bfloat16", 28), ("f32", "float32", 28)] {
        let json = dir.path().join(format!("{dtype}.json"));
        let out = strata(&[
            "bench",
            "optim",
            "--params",
            "200000",
            "--chunk",
            "64k",
            "--steps",
            "2",
            "--dtype",
            dtype,
            "--roofline",
            "--quiet",
            "--json",
            json.to_str().unwrap(),
        ]);
        let v = report(&out, &json);
        assert_eq!(v["dtype"], name);
        let r = &v["roofline"];
        assert!(r["triad_bytes_per_sec"].as_f64().unwrap() > 0.0);
        assert_eq!(r["bytes_per_param"], 28);
        assert_eq!(r["moved_per_param"], moved);
        let want = 28.0 * 200000.0 / r["triad_bytes_per_sec"].as_f64().unwrap();
        assert!((r["bound_seconds"].as_f64().unwrap() - want).abs() <= 1e-9 * want.max(1.0));
        let frac = want / v["step_seconds"].as_f64().unwrap();
        assert!((r["fraction"].as_f64().unwrap() - frac).abs() <= 1e-9 * frac.max(1.0));
        assert!(String::from_utf8_lossy(&out.stdout).contains("of the roofline"));
    }
    // Importance-aware: whole windows are timed (3 steps asked, windows of
    // 2: 4 timed), and one step in two moves the state.
    let json = dir.path().join("imp.json");
    let out = strata(&[
        "bench",
        "optim",
        "--params",
        "200000",
        "--chunk",
        "64k",
        "--steps",
        "3",
        "--importance",
        "0.25:2",
        "--quiet",
        "--json",
        json.to_str().unwrap(),
    ]);
    let v = report(&out, &json);
    assert_eq!(v["timed_steps"], 4);
    assert_eq!(v["params"]["importance"]["every"], 2);
    let state = v["state_bytes"].as_f64().unwrap();
    assert_eq!(v["state_bytes_per_step"].as_f64().unwrap(), state);
    for bad in ["0.1", "0:4", "1.5:2", "0.1:0", "x:y"] {
        assert_bad_input(
            &strata(&["bench", "optim", "--importance", bad, "--quiet"]),
            "--importance",
        );
    }
}

/// Where a case's stdout goes.
#[derive(Clone, Copy, PartialEq)]
enum Stdout {
    /// Captured.
    Pipe,
    /// A pipe whose reader has already gone (EPIPE on the first write).
    ClosedPipe,
    /// `/dev/full` (ENOSPC on the first write).
    Full,
}

/// What a case must give.
enum Expect {
    /// Status 2, one stderr line containing this.
    Bad(&'static str),
    /// Status 1 (an output that could not be written), one line with this.
    Failed(&'static str),
    /// Status 0, nothing on stderr.
    Ok,
    /// Status 0 and one warning line containing this.
    Warns(&'static str),
}

struct Case {
    args: Vec<String>,
    env: Vec<(&'static str, String)>,
    stdout: Stdout,
    expect: Expect,
    /// An output path the run must leave absent.
    refused: Option<std::path::PathBuf>,
}

fn case(args: &[&str], expect: Expect) -> Case {
    Case {
        args: args.iter().map(|s| s.to_string()).collect(),
        env: Vec::new(),
        stdout: Stdout::Pipe,
        expect,
        refused: None,
    }
}

impl Case {
    fn env(mut self, key: &'static str, value: &str) -> Self {
        self.env.push((key, value.to_string()));
        self
    }
    fn stdout(mut self, s: Stdout) -> Self {
        self.stdout = s;
        self
    }
    fn refuses(mut self, path: &std::path::Path) -> Self {
        self.refused = Some(path.to_path_buf());
        self
    }
}

/// A pipe's write end whose read end is already closed.
fn closed_pipe() -> std::process::Stdio {
    use std::os::fd::FromRawFd;
    let mut fds = [0i32; 2];
    // SAFETY: `fds` is writable storage for the two descriptors pipe(2)
    // returns.
    assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
    // SAFETY: pipe(2) succeeded, so both descriptors are open and ours;
    // each is owned by exactly one OwnedFd.
    let (read, write) = unsafe {
        (
            std::os::fd::OwnedFd::from_raw_fd(fds[0]),
            std::os::fd::OwnedFd::from_raw_fd(fds[1]),
        )
    };
    drop(read);
    std::process::Stdio::from(write)
}

/// Every class of bad input: each gives its documented status
/// and exactly one stderr line naming the flag or path, never a panic or
/// an abort, and leaves no file at an output path it refused.
#[test]
fn no_input_crashes_it_and_every_refusal_is_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let p = |name: &str| d.join(name).to_str().unwrap().to_string();
    std::fs::write(d.join("two.txt"), "1\n2\n").unwrap();
    std::fs::write(d.join("bad.txt"), "1\nseven\n").unwrap();
    std::fs::write(d.join("empty.txt"), "").unwrap();
    std::fs::write(
        d.join("cxl.toml"),
        "[cxl]\nmode = \"emulated\"\nlatency_ns = 2000000\n",
    )
    .unwrap();
    std::fs::write(d.join("route.txt"), "0 0 1\n0 1 2\n1 0 3\n1 1 0\n").unwrap();
    std::fs::write(
        d.join("bad.toml"),
        "page_size = \"64k\"\n[host]\ncapacity = \"3q\"\n",
    )
    .unwrap();
    std::fs::write(
        d.join("nvme.toml"),
        format!("[nvme]\npath = {:?}\n", p("cfgdir")),
    )
    .unwrap();
    // The tier off, the path still the benches'.
    std::fs::write(
        d.join("nvme0.toml"),
        format!("[nvme]\npath = {:?}\ncapacity = 0\n", p("cfgdir")),
    )
    .unwrap();
    // The page size the message quotes is not the line at fault.
    std::fs::write(
        d.join("quoted.toml"),
        format!(
            "page_size = 4096\n[nvme]\npath = {:?}\ncapacity = \"6k\"\n",
            p("cfgdir")
        ),
    )
    .unwrap();
    std::fs::create_dir(d.join("cfgdir")).unwrap();
    let two = p("two.txt");
    let out_json = d.join("out.json");
    let json = out_json.to_str().unwrap().to_string();
    let missing = "/nonexistent-strata-dir/x.svg";
    let s = |v: &str| v.to_string();
    let a = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
    let with = |base: &[&str], extra: &[String]| {
        let mut v = a(base);
        v.extend_from_slice(extra);
        v
    };
    let route = p("route.txt");
    let mut cases = vec![
        // A routing trace of 2 layers, asked to route 5 (it once indexed
        // past them), or written over by the report.
        case(
            &[
                "bench",
                "moe",
                "--quiet",
                "--expert-bytes",
                "64k",
                "--routing",
                &format!("file:{route}"),
                "--layers",
                "5",
            ],
            Expect::Bad("never routes"),
        ),
        case(
            &[
                "bench",
                "moe",
                "--quiet",
                "--expert-bytes",
                "64k",
                "--routing",
                &format!("file:{route}"),
                "--json",
                &route,
            ],
            Expect::Bad("name the same file"),
        ),
        // A Zipf law so steep that drawing distinct experts by rejection
        // never ended.
        case(
            &[
                "bench",
                "moe",
                "--quiet",
                "--layers",
                "2",
                "--experts",
                "8",
                "--tokens",
                "4",
                "--expert-bytes",
                "64k",
                "--routing",
                "zipf:50",
            ],
            Expect::Ok,
        ),
        // A list naming an entry twice; a flag for a policy not replayed.
        case(
            &[
                "trace",
                "replay",
                "--trace",
                &two,
                "--capacity-pages",
                "2",
                "--policy",
                "lru,lru",
            ],
            Expect::Bad("names lru twice"),
        ),
        case(
            &[
                "trace",
                "replay",
                "--trace",
                &two,
                "--capacity-pages",
                "2",
                "--window",
                "3",
                "--policy",
                "lfu",
            ],
            Expect::Bad("--window applies to lookahead only"),
        ),
        case(
            &["bench", "copy", "--size", "6k", "--page-sizes", "4k"],
            Expect::Bad("not a whole number of 4K pages"),
        ),
        // A config that is a device (endless) or empty by environment.
        case(
            &["--config", "/dev/zero", "info"],
            Expect::Bad("not a regular file"),
        ),
        case(&["info"], Expect::Bad("STRATA_CONFIG is empty")).env("STRATA_CONFIG", ""),
        // A scale out of range, priced before it was checked.
        case(
            &[
                "trace",
                "gen",
                "--kind",
                "bfs",
                "--scale",
                "64",
                "--out",
                &p("g.txt"),
            ],
            Expect::Bad("--scale 64 is not in 1..=28"),
        ),
        // Flags that would be silently ignored.
        case(
            &["bench", "optim", "--tier", "host", "--path", &p("cfgdir")],
            Expect::Bad("--path is the NVMe tier's"),
        ),
        // Fewer parameters than a chunk: its padding would be timed.
        case(
            &["bench", "optim", "--params", "1", "--steps", "1"],
            Expect::Bad("less than one chunk"),
        ),
        // Sizes that would abort on a failed allocation.
        case(
            &["bench", "optim", "--params", "10000000000000"],
            Expect::Bad("--params 10000000000000 needs about"),
        ),
        case(
            &["bench", "recsys", "--rows", "4294967295"],
            Expect::Bad("--rows 4294967295"),
        ),
        // Indices no memory holds name the flags that set their number.
        case(
            &["bench", "recsys", "--pooling", "100000000"],
            Expect::Bad("--pooling 100000000"),
        ),
        case(
            &["bench", "graph", "--graph", "kron:30:1024", "--quiet"],
            Expect::Bad("--graph kron:30:1024"),
        ),
        case(&["bench", "copy", "--size", "100T"], Expect::Bad("--size")),
        case(
            &[
                "bench",
                "moe",
                "--layers",
                "1000",
                "--experts",
                "1000",
                "--expert-bytes",
                "1G",
                "--tokens",
                "1",
            ],
            Expect::Bad("--expert-bytes"),
        ),
        case(
            &[
                "trace",
                "gen",
                "--kind",
                "zipf",
                "--accesses",
                "100000000000000",
                "--out",
                &p("huge.txt"),
            ],
            Expect::Bad("--accesses"),
        )
        .refuses(&d.join("huge.txt")),
        // A sequence of reads, or bounds over a DRAM, that no memory holds.
        case(
            &[
                "bench",
                "pages",
                "--data",
                "1M",
                "--dram",
                "256k",
                "--path",
                &p(""),
                "--ops",
                "100000000000",
            ],
            Expect::Bad("--ops 100000000000"),
        ),
        // A setting of strata's where only the page cache runs.
        case(
            &[
                "bench",
                "pages",
                "--data",
                "16M",
                "--dram",
                "4M",
                "--path",
                &p(""),
                "--ops",
                "200",
                "--configs",
                "os",
                "--min-accesses",
                "3",
            ],
            Expect::Bad("--min-accesses is strata's"),
        ),
        // A config file named is checked by every command, even one that
        // takes no setting from it.
        case(
            &[
                "--config",
                &p("no-such.toml"),
                "trace",
                "gen",
                "--kind",
                "zipf",
                "--accesses",
                "10",
                "--out",
                &p("never.txt"),
            ],
            Expect::Bad("no-such.toml"),
        )
        .refuses(&d.join("never.txt")),
        // An output over an input: the trace stays as it was.
        case(
            &[
                "trace",
                "replay",
                "--trace",
                &two,
                "--capacity-pages",
                "2",
                "--json",
                &two,
            ],
            Expect::Bad("name the same file"),
        ),
        // A device is no trace: /dev/zero is one endless line.
        case(
            &[
                "trace",
                "replay",
                "--trace",
                "/dev/zero",
                "--capacity-pages",
                "2",
            ],
            Expect::Bad("not a regular file"),
        ),
        // A capacity far above the trace's pages runs, as if equal to them.
        case(
            &[
                "trace",
                "replay",
                "--trace",
                &two,
                "--capacity-pages",
                "1000000000",
                "--policy",
                "all",
            ],
            Expect::Ok,
        ),
        // Negative, zero, malformed and oversized numbers.
        case(
            &["bench", "io", "--path", &p(""), "--size", "-5M"],
            Expect::Bad("--size"),
        ),
        case(
            &["bench", "io", "--size", "1M", "--qd", "-1"],
            Expect::Bad("--qd"),
        ),
        case(
            &["bench", "io", "--size", "99999999999999999999999"],
            Expect::Bad("--size"),
        ),
        case(
            &["bench", "io", "--size", "1M", "--bs", "0"],
            Expect::Bad("--bs"),
        ),
        case(
            &["bench", "migrate", "--page-sizes", "3k", "--size", "1M"],
            Expect::Bad("--page-sizes"),
        ),
        case(
            &["bench", "migrate", "--page-sizes", "4k", "--size", "0"],
            Expect::Bad("--size"),
        ),
        case(&["bench", "copy", "--size", "-1"], Expect::Bad("--size")),
        // A directory no file can be made in: named as such.
        case(
            &["bench", "migrate", "--path", "/proc", "--size", "4M"],
            Expect::Bad("creating a swap file in /proc"),
        ),
        case(
            &["bench", "copy", "--cxl-bandwidth", "0"],
            Expect::Bad("--cxl-bandwidth: link bandwidth 0"),
        ),
        case(
            &["bench", "copy", "--cxl-latency-ns", "99999999999"],
            Expect::Bad("--cxl-latency-ns: link latency"),
        ),
        case(
            &["bench", "pages", "--data", "4M", "--dram", "-5M"],
            Expect::Bad("--dram"),
        ),
        case(
            &["bench", "priority", "--data", "-1G"],
            Expect::Bad("--data"),
        ),
        case(
            &["bench", "graph", "--page-size", "0", "--quiet"],
            Expect::Bad("--page-size"),
        ),
        case(
            &[
                "bench",
                "recsys",
                "--rows",
                "64",
                "--batches",
                "1",
                "--quiet",
            ],
            Expect::Bad("less than a page"),
        ),
        // A budget below one page, refused before a graph is made.
        case(
            &["bench", "graph", "--device-budget", "4k", "--quiet"],
            Expect::Bad("--device-budget 4k holds no"),
        ),
        case(
            &["bench", "graph", "--device-budget", "-5%", "--quiet"],
            Expect::Bad("--device-budget"),
        ),
        case(
            &["bench", "graph", "--graph", "kron:99", "--quiet"],
            Expect::Bad("--graph"),
        ),
        case(
            &["bench", "recsys", "--page-size", "3k", "--quiet"],
            Expect::Bad("--page-size"),
        ),
        case(
            &["bench", "recsys", "--rows", "0", "--quiet"],
            Expect::Bad("--rows"),
        ),
        case(
            &["bench", "moe", "--expert-bytes", "-1"],
            Expect::Bad("--expert-bytes"),
        ),
        case(
            &["bench", "moe", "--expert-bytes", "0"],
            Expect::Bad("--expert-bytes"),
        ),
        case(&["bench", "optim", "--chunk", "3k"], Expect::Bad("--chunk")),
        case(
            &["bench", "optim", "--params", "0"],
            Expect::Bad("--params"),
        ),
        case(
            &["trace", "replay", "--trace", &two, "--capacity-pages", "-4"],
            Expect::Bad("--capacity-pages"),
        ),
        case(
            &["trace", "replay", "--trace", &two, "--capacity-pages", "0"],
            Expect::Bad("--capacity-pages"),
        ),
        case(
            &[
                "trace",
                "gen",
                "--kind",
                "bfs",
                "--page-size",
                "-1",
                "--out",
                &p("g.txt"),
            ],
            Expect::Bad("--page-size"),
        )
        .refuses(&d.join("g.txt")),
        // Sizes take binary suffixes, --row-bytes too.
        case(
            &[
                "trace",
                "gen",
                "--kind",
                "emb",
                "--row-bytes",
                "1k",
                "--batches",
                "1",
                "--out",
                &p("emb.txt"),
            ],
            Expect::Ok,
        ),
        case(
            &[
                "trace",
                "gen",
                "--kind",
                "emb",
                "--row-bytes",
                "1q",
                "--out",
                &p("emb.txt"),
            ],
            Expect::Bad("--row-bytes"),
        ),
        // Bad enums and usage.
        case(
            &["bench", "io", "--size", "1M", "--pattern", "sideways"],
            Expect::Bad("--pattern"),
        ),
        case(&["bench", "optim", "--tier", "disk"], Expect::Bad("--tier")),
        case(
            &["bench", "graph", "--algo", "dfs", "--quiet"],
            Expect::Bad("--algo"),
        ),
        case(
            &["bench", "recsys", "--policy", "mru", "--quiet"],
            Expect::Bad("--policy"),
        ),
        case(
            &["bench", "moe", "--device", "tpu"],
            Expect::Bad("--device"),
        ),
        case(
            &[
                "trace",
                "replay",
                "--trace",
                &two,
                "--capacity-pages",
                "4",
                "--policy",
                "mru",
            ],
            Expect::Bad("--policy"),
        ),
        case(&["bench", "frobnicate"], Expect::Bad("frobnicate")),
        case(&["bench", "--frob"], Expect::Bad("--frob")),
        case(&["bench"], Expect::Bad("bench needs a subcommand")),
        case(&[], Expect::Bad("subcommand")),
        case(&["trace", "replay"], Expect::Bad("--trace")),
        // Input files: a bad line, empty, a directory, nonexistent.
        case(
            &[
                "trace",
                "replay",
                "--trace",
                &p("bad.txt"),
                "--capacity-pages",
                "4",
            ],
            Expect::Bad("line 2"),
        ),
        case(
            &[
                "trace",
                "replay",
                "--trace",
                &p("empty.txt"),
                "--capacity-pages",
                "4",
            ],
            Expect::Bad("holds no accesses"),
        ),
        case(
            &[
                "trace",
                "replay",
                "--trace",
                &p(""),
                "--capacity-pages",
                "4",
            ],
            Expect::Bad("is a directory"),
        ),
        case(
            &[
                "trace",
                "replay",
                "--trace",
                "/nonexistent-strata-dir/t",
                "--capacity-pages",
                "4",
            ],
            Expect::Bad("/nonexistent-strata-dir/t"),
        ),
        case(
            &[
                "bench",
                "graph",
                "--graph",
                &format!("file:{}", p("")),
                "--quiet",
            ],
            Expect::Bad("is a directory"),
        ),
        case(
            &[
                "bench",
                "moe",
                "--routing",
                "file:/nonexistent-strata-dir/r",
            ],
            Expect::Bad("/nonexistent-strata-dir/r"),
        ),
        case(
            &[
                "bench",
                "recsys",
                "--dist",
                &format!("file:{}", p("")),
                "--quiet",
            ],
            Expect::Bad("is a directory"),
        ),
        // Paths for the NVMe tier.
        case(
            &[
                "bench",
                "io",
                "--path",
                "/nonexistent-strata-dir/d/f",
                "--size",
                "1M",
            ],
            Expect::Bad("/nonexistent-strata-dir"),
        ),
        case(
            &["bench", "io", "--path", &format!("{two}/f"), "--size", "1M"],
            Expect::Bad("two.txt"),
        ),
        // Output paths, checked before the run and left absent.
        case(
            &[
                "bench", "graph", "--graph", "kron:4", "--trials", "1", "--quiet", "--plot",
                missing,
            ],
            Expect::Bad(missing),
        ),
        case(
            &[
                "bench",
                "recsys",
                "--rows",
                "64",
                "--batches",
                "1",
                "--quiet",
                "--plot",
                &p(""),
            ],
            Expect::Bad("--plot"),
        ),
        case(
            &["bench", "optim", "--params", "0", "--json", &json],
            Expect::Bad("--params"),
        )
        .refuses(&out_json),
        case(
            &[
                "trace",
                "replay",
                "--trace",
                &two,
                "--capacity-pages",
                "4",
                "--json",
                "/nonexistent-strata-dir/r.json",
            ],
            Expect::Bad("--json"),
        ),
        case(
            &[
                "trace",
                "gen",
                "--kind",
                "zipf",
                "--accesses",
                "10",
                "--out",
                &p(""),
            ],
            Expect::Bad("--out"),
        ),
        case(
            &[
                "bench",
                "graph",
                "--graph",
                "kron:4",
                "--quiet",
                "--dump",
                "/nonexistent-strata-dir/d",
            ],
            Expect::Bad("--dump"),
        ),
        // Output that cannot be written: status 1, one line.
        case(
            &[
                "trace",
                "replay",
                "--trace",
                &two,
                "--capacity-pages",
                "4",
                "--json",
                "/dev/full",
            ],
            Expect::Failed("writing /dev/full (--json): No space left on device"),
        ),
        case(
            &["info", "--json"],
            Expect::Failed("writing stdout: No space left on device"),
        )
        .stdout(Stdout::Full),
        case(
            &["trace", "replay", "--trace", &two, "--capacity-pages", "4"],
            Expect::Failed("writing stdout"),
        )
        .stdout(Stdout::Full),
        // A reader that left is no failure.
        case(&["info"], Expect::Ok).stdout(Stdout::ClosedPipe),
        case(&["info", "--json"], Expect::Ok).stdout(Stdout::ClosedPipe),
        case(
            &[
                "trace",
                "replay",
                "--trace",
                &two,
                "--capacity-pages",
                "4",
                "--json",
                &p("ok.json"),
            ],
            Expect::Ok,
        )
        .stdout(Stdout::ClosedPipe),
        // Configuration: the file's line, the variable.
        case(
            &["info", "--config", &p("bad.toml")],
            Expect::Bad("bad.toml line 3 (--config)"),
        ),
        case(&["info"], Expect::Bad("bad.toml line 3 ($STRATA_CONFIG)"))
            .env("STRATA_CONFIG", &p("bad.toml")),
        case(
            &["info", "--config", &p("quoted.toml")],
            Expect::Bad("quoted.toml line 4 (--config)"),
        ),
        // Policy names in any case, as the other names.
        case(&["info"], Expect::Ok).env("STRATA_POLICY", " LRU"),
        // Removing either the mode or the value mends it: the value's line.
        case(
            &["info", "--config", &p("cxl.toml")],
            Expect::Bad("cxl.toml line 3 (--config)"),
        ),
        case(&["info", "--config", &p("")], Expect::Bad("is a directory")),
        case(
            &["info", "--config", "/nonexistent-strata-dir/c.toml"],
            Expect::Bad("/nonexistent-strata-dir/c.toml"),
        ),
        case(&["info"], Expect::Bad("STRATA_POLICY")).env("STRATA_POLICY", "mru"),
        case(&["info"], Expect::Bad("STRATA_PAGE_SIZE")).env("STRATA_PAGE_SIZE", "3k"),
        case(&["info"], Expect::Bad("STRATA_IO_ENGINE")).env("STRATA_IO_ENGINE", "aio"),
        case(&["info"], Expect::Bad("STRATA_HOST_CAPACITY")).env("STRATA_HOST_CAPACITY", "0"),
        case(
            &["bench", "optim", "--tier", "nvme", "--params", "1000"],
            Expect::Bad("STRATA_NVME_CAPACITY"),
        )
        .env("STRATA_NVME_PATH", &p("cfgdir"))
        .env("STRATA_NVME_CAPACITY", "lots"),
    ];
    // The configured NVMe path is used when --path is not given.
    let small_optim = a(&[
        "bench", "optim", "--tier", "nvme", "--params", "2000", "--steps", "1", "--chunk", "4k",
        "--quiet",
    ]);
    cases.push(Case {
        args: with(&[], &small_optim)
            .into_iter()
            .chain([s("--config"), p("nvme.toml"), s("--json"), p("cfg.json")])
            .collect(),
        ..case(&[], Expect::Ok)
    });
    cases.push(Case {
        args: with(&[], &small_optim)
            .into_iter()
            .chain([s("--config"), p("nvme0.toml"), s("--json"), p("cfg0.json")])
            .collect(),
        ..case(&[], Expect::Ok)
    });
    // A RAM-backed NVMe path: one warning line, the run goes on.
    if std::path::Path::new("/dev/shm").is_dir() {
        cases.push(Case {
            args: with(&[], &small_optim)
                .into_iter()
                .chain([s("--path"), s("/dev/shm")])
                .collect(),
            ..case(&[], Expect::Warns("tmpfs"))
        });
        cases.push(
            case(
                &["bench", "migrate", "--page-sizes", "4k", "--size", "64k"],
                Expect::Warns("/dev/shm is on tmpfs"),
            )
            .env("STRATA_NVME_PATH", "/dev/shm"),
        );
    }

    let mut failures = Vec::new();
    for c in &cases {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_strata"));
        cmd.args(&c.args).current_dir(d).env_remove("STRATA_CONFIG");
        for (k, v) in &c.env {
            cmd.env(k, v);
        }
        match c.stdout {
            Stdout::Pipe => cmd.stdout(std::process::Stdio::piped()),
            Stdout::ClosedPipe => cmd.stdout(closed_pipe()),
            Stdout::Full => cmd.stdout(
                std::fs::OpenOptions::new()
                    .write(true)
                    .open("/dev/full")
                    .unwrap(),
            ),
        };
        let out = cmd
            .stderr(std::process::Stdio::piped())
            .output()
            .expect("strata runs");
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        let lines = err.trim_end().lines().count();
        let (status, want_lines, needle) = match &c.expect {
            Expect::Bad(n) => (2, 1, *n),
            Expect::Failed(n) => (1, 1, *n),
            Expect::Ok => (0, 0, ""),
            Expect::Warns(n) => (0, 1, *n),
        };
        let mut why = Vec::new();
        if out.status.code() != Some(status) {
            why.push(format!("status {:?}, want {status}", out.status.code()));
        }
        if lines != want_lines {
            why.push(format!("{lines} stderr lines, want {want_lines}"));
        }
        if !err.contains(needle) {
            why.push(format!("no {needle:?}"));
        }
        if err.contains("panicked") || err.contains("RUST_BACKTRACE") {
            why.push("a panic".into());
        }
        if let Some(path) = &c.refused {
            if path.exists() {
                why.push(format!("{} was written", path.display()));
            }
        }
        if !why.is_empty() {
            failures.push(format!("{:?}: {}\n  stderr: {err}", c.args, why.join("; ")));
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
    // The replay that clamped its capacity says so, and the configured
    // path was the NVMe tier's.
    assert!(
        d.join("ok.json").exists(),
        "a closed stdout still writes --json"
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("cfg.json")).unwrap()).unwrap();
    assert_eq!(v["params"]["path"], p("cfgdir"));
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(d.join("cfg0.json")).unwrap()).unwrap();
    assert_eq!(v["params"]["path"], p("cfgdir"), "capacity 0 kept the path");
}

#[test]
fn trace_replay_capacity_above_the_pages_touched_replays_as_them() {
    let dir = tempfile::tempdir().unwrap();
    let t = dir.path().join("t.txt");
    std::fs::write(&t, "1\n2\n1\n3\n2\n").unwrap();
    let run = |cap: &str, json: &std::path::Path| {
        report(
            &strata(&[
                "trace",
                "replay",
                "--trace",
                t.to_str().unwrap(),
                "--capacity-pages",
                cap,
                "--policy",
                "all",
                "--json",
                json.to_str().unwrap(),
            ]),
            json,
        )
    };
    let big = run("1000000000", &dir.path().join("big.json"));
    let exact = run("3", &dir.path().join("exact.json"));
    assert_eq!(
        big.as_array().unwrap().len(),
        strata::policy::PolicyKind::ALL.len()
    );
    assert_eq!(
        exact.as_array().unwrap().len(),
        big.as_array().unwrap().len()
    );
    for (b, e) in big
        .as_array()
        .unwrap()
        .iter()
        .zip(exact.as_array().unwrap())
    {
        assert_eq!(b["hits"], e["hits"], "{b} vs {e}");
        assert_eq!(b["misses"], e["misses"]);
        assert_eq!(b["capacity_pages"], 1000000000);
        assert_eq!(b["effective_capacity_pages"], 3);
    }
}

#[test]
fn help_and_version_still_print_with_status_0() {
    for args in [&["--help"][..], &["--version"], &["bench", "io", "--help"]] {
        let out = strata(args);
        assert_eq!(out.status.code(), Some(0), "{args:?}");
        assert!(!out.stdout.is_empty());
    }
}

#[test]
fn info_names_what_is_wrong_with_each_configured_tier() {
    let out = strata_env(&["info"], "STRATA_NVME_PATH", "/nonexistent/swap");
    assert_bad_input(&out, "the nvme tier: directory /nonexistent does not exist");
    let table = String::from_utf8_lossy(&out.stdout);
    assert!(table.contains("problem: directory /nonexistent"), "{table}");
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("c.toml");
    std::fs::write(&config, "[host]\nnuma_node = 4000\n").unwrap();
    let out = strata(&["--config", config.to_str().unwrap(), "info", "--json"]);
    assert_bad_input(&out, "numa_node 4000 does not exist");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let host = v["tiers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|t| t["tier"] == "host")
        .unwrap();
    assert!(host["problem"].as_str().unwrap().contains("4000"));
    // A host tier larger than the machine (the arena is mapped whole when a
    // runtime starts, and refused then).
    std::fs::write(&config, "[host]\ncapacity = \"64T\"\n").unwrap();
    let out = strata(&["--config", config.to_str().unwrap(), "info"]);
    assert_bad_input(&out, "more than this machine's");
    // Capacity 0 turns the NVMe tier off.
    let out = strata_env(&["info", "--json"], "STRATA_NVME_CAPACITY", "0");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert!(v["tiers"]
        .as_array()
        .unwrap()
        .iter()
        .all(|t| t["tier"] != "nvme"));
}

#[test]
fn a_refused_run_leaves_no_file_behind_a_dangling_link() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("bad.trace");
    std::fs::write(&trace, "1\nnot a page\n").unwrap();
    let target = dir.path().join("report.json");
    let link = dir.path().join("link.json");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let out = strata(&[
        "trace",
        "replay",
        "--trace",
        trace.to_str().unwrap(),
        "--capacity-pages",
        "4",
        "--json",
        link.to_str().unwrap(),
    ]);
    assert_bad_input(&out, "line 2");
    assert!(!target.exists(), "the link's target was created and left");
    assert!(link.symlink_metadata().is_ok(), "the link itself stays");
}

#[test]
fn bench_graph_runs_chosen_configurations_on_a_platform() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("g.json");
    let out = strata(&[
        "bench",
        "graph",
        "--algo",
        "pr",
        "--graph",
        "kron:10",
        "--device-budget",
        "100%",
        "--page-size",
        "64k",
        "--configs",
        "resident,uvm,static-optimum",
        "--platform",
        "v100-pcie3",
        "--trials",
        "1",
        "--verify",
        "--quiet",
        "--json",
        json.to_str().unwrap(),
    ]);
    let r = report(&out, &json);
    assert_eq!(r["model"]["name"], "v100-pcie3");
    let results = r["results"].as_array().unwrap();
    let names: Vec<&str> = results
        .iter()
        .map(|c| c["config"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["resident", "uvm", "static-optimum"]);
    // resident is wall time with no model; the others say what they cost.
    assert!(results[0]["trials"][0]["cost"].is_null());
    assert!(results[0]["hit_rate"].is_null());
    let uvm = &results[1]["trials"][0]["cost"];
    assert!(uvm["uvm"].as_f64().unwrap() > 0.0, "{uvm}");
    assert!(
        uvm["detail"]["uvm"]["faults"].as_u64().unwrap() > 0,
        "{uvm}"
    );
    // A budget that holds the graph (in 64 KiB pages, Unified Memory's
    // blocks): the static optimum reads nothing over the link, and Unified
    // Memory moves each byte in at most once.
    let so = &results[2]["trials"][0]["cost"]["detail"]["traffic"];
    assert_eq!(so["host_requests"], 0, "{so}");
    assert!(
        uvm["detail"]["uvm"]["bytes_in"].as_u64().unwrap() <= r["budget_bytes"].as_u64().unwrap(),
        "{uvm}"
    );
    assert!(results.iter().all(|c| c["trials"][0]["verified"] == true));
}

#[test]
fn bench_graph_refuses_unknown_platforms_and_configurations() {
    for (flag, value, needle) in [
        ("--platform", "gtx480", "unknown platform"),
        ("--configs", "strata,uvm-lru", "unknown configuration"),
    ] {
        let out = strata(&["bench", "graph", "--graph", "kron:8", flag, value]);
        assert_bad_input(&out, needle);
    }
    // strata's balancer's settings, where --configs does not run strata,
    // would change nothing.
    for (flag, value) in [("--policy", "lru"), ("--min-accesses", "5")] {
        let out = strata(&[
            "bench",
            "graph",
            "--graph",
            "kron:8",
            "--configs",
            "uvm",
            flag,
            value,
        ]);
        assert_bad_input(&out, &format!("{flag} is strata's"));
    }
}

#[test]
fn bench_priority_reports_busy_and_idle_phases() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("prio.json");
    let out = strata(&[
        "bench",
        "priority",
        "--data",
        "16M",
        "--path",
        dir.path().to_str().unwrap(),
        "--ops",
        "20",
        "--trials",
        "2",
        "--quiet",
        "--json",
        json.to_str().unwrap(),
    ]);
    let r = report(&out, &json);
    let phases = r["phases"].as_array().unwrap();
    let names: Vec<&str> = phases
        .iter()
        .map(|p| p["phase"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["busy", "idle", "busy", "idle"]);
    for p in phases.iter().filter(|p| p["phase"] == "idle") {
        assert_eq!(p["promote"]["n"], 20, "{p}");
        assert!(p["promote"]["p50_us"].as_f64().unwrap() > 0.0);
        assert!(p["demote"]["p99_us"].as_f64().unwrap() > 0.0);
    }
    assert!(r["ratio_promote_p50"].is_number() || r["ratio_promote_p50"].is_null());
}

#[test]
fn bench_priority_rejects_bad_input() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().to_str().unwrap();
    assert_bad_input(
        &strata(&["bench", "priority", "--data", "64k", "--path", path]),
        "--data",
    );
    assert_bad_input(
        &strata(&[
            "bench", "priority", "--data", "16M", "--dram", "1M", "--path", path,
        ]),
        "--dram",
    );
    assert_bad_input(
        &strata(&[
            "bench", "priority", "--data", "16M", "--ops", "0", "--path", path,
        ]),
        "--ops",
    );
}

#[test]
fn bench_graph_caps_a_device_budget_above_the_graph_and_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("g.json");
    let out = strata(&[
        "bench",
        "graph",
        "--graph",
        "kron:8",
        "--algo",
        "bfs",
        "--device-budget",
        "1T",
        "--configs",
        "strata,uvm,all-device",
        "--trials",
        "1",
        "--verify",
        "--quiet",
        "--json",
        json.to_str().unwrap(),
    ]);
    let r = report(&out, &json);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.contains("--device-budget 1T is more than the graph needs: capped to"),
        "{stdout}"
    );
    assert_eq!(r["budget_requested"], 1u64 << 40);
    let budget = r["budget_bytes"].as_u64().unwrap();
    let graph = r["graph_bytes"].as_u64().unwrap();
    assert!(budget >= graph && budget < 1 << 30, "{budget} for {graph}");
    // Capped, every configuration holds the whole graph on the device:
    // each moves it in once (Unified Memory's first touches fault) and
    // nothing is evicted.
    for c in r["results"].as_array().unwrap() {
        assert_eq!(c["trials"][0]["verified"], true, "{c}");
        assert!(c["bytes_moved"].as_u64().unwrap() <= budget, "{c}");
        if c["config"] != "uvm" {
            assert_eq!(c["hit_rate"], 1.0, "{c}");
        }
    }
    // A budget the graph fills is not capped, and the report says nothing.
    let out = strata(&[
        "bench",
        "graph",
        "--graph",
        "kron:8",
        "--algo",
        "bfs",
        "--device-budget",
        "16k",
        "--page-size",
        "4k",
        "--trials",
        "1",
        "--quiet",
        "--json",
        json.to_str().unwrap(),
    ]);
    let r = report(&out, &json);
    assert_eq!(r["budget_bytes"], 16384);
    assert!(r.get("budget_requested").is_none(), "{r}");
    assert!(!String::from_utf8_lossy(&out.stdout).contains("capped"));
}

#[test]
fn bench_graph_refuses_a_binary_file_as_an_edge_list() {
    let dir = tempfile::tempdir().unwrap();
    for (name, bytes) in [
        // Not UTF-8.
        (
            "random.el",
            vec![0x7f, b'E', b'L', b'F', 0xff, 0xfe, b'\n', 0x80],
        ),
        // UTF-8, but NULs: no text file has them.
        ("zeros.wel", vec![0u8; 4096]),
        // Text, but one line longer than any edge list has.
        ("long.el", vec![b'7'; 100_000]),
    ] {
        let path = dir.path().join(name);
        std::fs::write(&path, &bytes).unwrap();
        let graph = format!("file:{}", path.display());
        let out = strata(&["bench", "graph", "--graph", &graph, "--quiet"]);
        assert_bad_input(&out, "so not an edge list");
        assert_bad_input(&out, &format!("{name} line 1"));
    }
}

#[test]
fn trace_gen_names_a_knob_its_kind_does_not_use() {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("t.txt");
    let out = out_path.to_str().unwrap();
    for (kind, knob, value, owner) in [
        ("zipf", "--scan-fraction", "0.5", "mix"),
        ("loop", "--scale", "8", "graph"),
        ("bfs", "--alphas", "1,1", "emb"),
        ("moe", "--page-size", "8k", "graph kinds and emb"),
        ("emb", "--tokens", "5", "moe"),
        ("shift", "--pooling", "3", "emb"),
    ] {
        let mut args = vec!["trace", "gen", "--kind", kind, knob, value, "--out", out];
        args.extend(if kind == "bfs" {
            ["--scale", "8"]
        } else {
            ["--accesses", "10"]
        });
        let run = strata(&args);
        let err = String::from_utf8_lossy(&run.stderr);
        assert!(run.status.success(), "{kind} {knob}: {err}");
        assert_eq!(err.lines().count(), 1, "{err}");
        assert!(
            err.contains(&format!("warning: {knob} is not used by --kind {kind}"))
                && err.contains(owner),
            "{err}"
        );
    }
    // The graph kernels share their knobs, and every kind takes a seed.
    for kind in ["bfs", "sssp", "pr", "cc"] {
        let run = strata(&[
            "trace",
            "gen",
            "--kind",
            kind,
            "--scale",
            "8",
            "--roots",
            "1",
            "--iterations",
            "1",
            "--seed",
            "3",
            "--out",
            out,
        ]);
        assert!(run.status.success(), "{kind}");
        assert!(
            run.stderr.is_empty(),
            "{kind}: {}",
            String::from_utf8_lossy(&run.stderr)
        );
    }
}

#[test]
fn trace_gen_refuses_a_count_that_makes_the_trace_empty() {
    let dir = tempfile::tempdir().unwrap();
    let out_path = dir.path().join("t.txt");
    let out = out_path.to_str().unwrap();
    for (kind, flag) in [
        ("bfs", "--roots"),
        ("sssp", "--roots"),
        ("pr", "--iterations"),
        ("emb", "--batches"),
        ("moe", "--tokens"),
        ("bfs", "--accesses"),
        ("zipf", "--accesses"),
    ] {
        let mut args = vec!["trace", "gen", "--kind", kind, flag, "0", "--out", out];
        if kind == "bfs" || kind == "sssp" || kind == "pr" {
            args.extend(["--scale", "8"]);
        }
        let run = strata(&args);
        assert_bad_input(&run, flag);
        assert!(!out_path.exists(), "{kind} {flag} 0 left {out}");
    }
    // One root is a trace.
    let run = strata(&[
        "trace", "gen", "--kind", "bfs", "--scale", "8", "--roots", "1", "--out", out,
    ]);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let t = std::fs::read_to_string(&out_path).unwrap();
    assert!(t.lines().filter(|l| !l.starts_with('#')).count() > 0);
}

/// A write that fails part-way (here past the file-size limit, EFBIG)
/// leaves no partial output: no new file, and an existing one as it was.
#[test]
fn an_output_that_fails_part_way_is_not_left_half_written() {
    use std::os::unix::process::CommandExt;
    let dir = tempfile::tempdir().unwrap();
    let fresh = dir.path().join("new.txt");
    let old = dir.path().join("old.txt");
    std::fs::write(&old, "1\n2\n").unwrap();
    for out in [&fresh, &old] {
        let mut cmd = Command::new(env!("CARGO_BIN_EXE_strata"));
        cmd.args([
            "trace",
            "gen",
            "--kind",
            "zipf",
            "--accesses",
            "100000",
            "--out",
            out.to_str().unwrap(),
        ]);
        // SAFETY: the closure runs in the child between fork and exec and
        // calls only setrlimit(2) and signal(2), which are
        // async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                let limit = libc::rlimit {
                    rlim_cur: 4096,
                    rlim_max: 4096,
                };
                if libc::setrlimit(libc::RLIMIT_FSIZE, &limit) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                // A write past the limit is then EFBIG, not a signal.
                libc::signal(libc::SIGXFSZ, libc::SIG_IGN);
                Ok(())
            });
        }
        let o = cmd.output().expect("strata runs");
        let err = String::from_utf8_lossy(&o.stderr);
        assert_eq!(o.status.code(), Some(1), "stderr: {err}");
        assert_eq!(err.trim_end().lines().count(), 1, "one line, got: {err}");
        assert!(err.contains("File too large"), "{err}");
    }
    assert!(!fresh.exists(), "a partial trace was left");
    assert_eq!(std::fs::read_to_string(&old).unwrap(), "1\n2\n");
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, ["old.txt"], "nothing else left behind");
}

/// The reports of the benches on DRAM and disk say, as every report does,
/// which backend their figures come from: none, no device tier.
#[test]
fn pages_and_priority_reports_name_their_backend() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let json = dir.path().join("r.json");
    let j = json.to_str().unwrap();
    for args in [
        &[
            "bench", "pages", "--data", "1M", "--dram", "256k", "--ops", "200", "--path", d,
            "--quiet", "--json", j,
        ][..],
        &[
            "bench", "priority", "--data", "4M", "--ops", "5", "--trials", "1", "--path", d,
            "--quiet", "--json", j,
        ][..],
    ] {
        let v = report(&strata(args), &json);
        assert_eq!(v["backend"], "none (DRAM and disk only)", "{}", args[1]);
    }
}
