//! The `kvroute` binary as a user runs it: bad start-up configuration ends
//! with one clear line and a non-zero exit; SIGTERM drains and exits 0.
#![allow(clippy::unwrap_used, clippy::expect_used)]
// std's clock: this test waits on a real kvroute process.
#![allow(clippy::disallowed_methods)]

use std::{
    io::{BufRead, BufReader},
    net::TcpListener,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

fn kvroute() -> Command {
    Command::new(env!("CARGO_BIN_EXE_kvroute"))
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// Runs `kvroute serve ARGS` expecting a quick failure; returns (code, stderr).
fn serve_fails(args: &[&str], env: &[(&str, &str)]) -> (i32, String) {
    let metrics = format!("127.0.0.1:{}", free_port());
    let output = kvroute()
        .arg("serve")
        .args(["--metrics-addr", &metrics])
        .args(args)
        .envs(env.iter().copied())
        .output()
        .expect("run kvroute");
    let stderr = String::from_utf8_lossy(&output.stderr).into_owned();
    (output.status.code().unwrap_or(-1), stderr)
}

fn assert_one_clear_line(stderr: &str, needle: &str) {
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "expected one line, got: {stderr}");
    assert!(lines[0].starts_with("kvroute: "), "{stderr}");
    assert!(lines[0].contains(needle), "{needle} not in {stderr}");
    assert!(
        !stderr.contains("panicked") && !stderr.contains("backtrace"),
        "{stderr}"
    );
}

#[test]
fn block_size_zero_is_refused() {
    let (code, stderr) = serve_fails(&["--block-size", "0"], &[]);
    assert_eq!(code, 2);
    assert_one_clear_line(&stderr, "--block-size");
}

#[test]
fn blocks_per_event_over_the_index_limit_are_refused() {
    // the index takes at most 2^24 - 1 blocks in one stored event
    let (code, stderr) = serve_fails(&["--max-blocks-per-event", "16777216"], &[]);
    assert_eq!(code, 2);
    assert_one_clear_line(&stderr, "--max-blocks-per-event");
}

#[test]
fn an_adapter_load_over_the_limit_is_refused() {
    // at most 2^24 tokens, so no estimate it is added to can overflow
    let (code, stderr) = serve_fails(&["--adapter-load-tokens", "16777217"], &[]);
    assert_eq!(code, 2);
    assert_one_clear_line(&stderr, "--adapter-load-tokens");
    let (code, stderr) = serve_fails(&[], &[("KVROUTE_ADAPTER_LOAD_TOKENS", "-1")]);
    assert_eq!(code, 2);
    assert_one_clear_line(&stderr, "--adapter-load-tokens");
}

#[test]
fn unparsable_address_is_refused() {
    let (code, stderr) = serve_fails(&["--grpc-addr", "not-an-address"], &[]);
    assert_eq!(code, 2);
    assert_one_clear_line(&stderr, "--grpc-addr");
}

#[test]
fn bad_env_var_is_refused_naming_the_setting() {
    let (code, stderr) = serve_fails(&[], &[("KVROUTE_REQUEST_TIMEOUT", "soon")]);
    assert_eq!(code, 2);
    assert_one_clear_line(&stderr, "--request-timeout");
}

/// Invalid settings found once the configuration is read (#38): a
/// malformed auth policy, a state directory that is a regular file. Each
/// exits 2 with one line saying it once.
#[test]
fn invalid_settings_read_at_start_exit_2_in_one_line() {
    let dir = std::env::temp_dir().join(format!("kvroute-cli-settings-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let policy = dir.join("policy.toml");
    std::fs::write(
        &policy,
        "[[identity]]\nname = \"a\"\nroles = [\"frontend\"\n",
    )
    .unwrap();
    let grpc = format!("127.0.0.1:{}", free_port());
    let (code, stderr) = serve_fails(
        &[
            "--grpc-addr",
            &grpc,
            "--log-level",
            "error",
            "--auth-policy",
            policy.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(code, 2, "{stderr}");
    assert_one_clear_line(&stderr, "--auth-policy");

    let file = dir.join("not-a-dir");
    std::fs::write(&file, "x").unwrap();
    let (code, stderr) = serve_fails(
        &[
            "--grpc-addr",
            &grpc,
            "--log-level",
            "error",
            "--state-dir",
            file.to_str().unwrap(),
        ],
        &[],
    );
    assert_eq!(code, 2, "{stderr}");
    assert_one_clear_line(&stderr, "is not a directory");
    assert_eq!(
        stderr.matches("not-a-dir").count(),
        1,
        "said once: {stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn port_in_use_is_refused_naming_the_setting() {
    let taken = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr").to_string();
    let (code, stderr) = serve_fails(&["--grpc-addr", &addr, "--log-level", "error"], &[]);
    assert_eq!(code, 1);
    assert_one_clear_line(&stderr, "grpc_addr");
    assert!(stderr.contains("in use"), "{stderr}");
}

#[test]
fn config_file_sits_between_env_and_defaults() {
    let dir = std::env::temp_dir().join(format!("kvroute-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let file = dir.join("kvroute.toml");
    std::fs::write(&file, "block_size = 0\n").expect("write");
    let path = file.to_string_lossy().into_owned();
    // The file's invalid value is reported like a flag's...
    let (code, stderr) = serve_fails(&["--config", &path], &[]);
    assert_eq!(code, 2);
    assert_one_clear_line(&stderr, "--block-size");
    // ...but a flag or an env var overrides the file, so the start gets past
    // configuration and fails later, on the occupied port.
    let taken = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = taken.local_addr().expect("addr").to_string();
    for (args, env) in [
        (vec!["--block-size", "32"], vec![]),
        (vec![], vec![("KVROUTE_BLOCK_SIZE", "32")]),
    ] {
        let mut all = vec!["--config", path.as_str(), "--grpc-addr", addr.as_str()];
        all.extend(args);
        let (code, stderr) = serve_fails(&all, &env);
        assert_eq!(code, 1, "{stderr}");
        assert!(stderr.contains("grpc_addr"), "{stderr}");
    }
    std::fs::write(&file, "no_such_setting = 1\n").expect("write");
    let (code, stderr) = serve_fails(&["--config", &path], &[]);
    assert_eq!(code, 2);
    assert_one_clear_line(&stderr, "no_such_setting");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn help_documents_every_setting() {
    let output = kvroute().args(["serve", "--help"]).output().expect("run");
    assert!(output.status.success());
    let help = String::from_utf8_lossy(&output.stdout);
    for flag in [
        "--grpc-addr",
        "--metrics-addr",
        "--block-size",
        "--log-format",
        "--log-level",
        "--max-message-bytes",
        "--request-timeout",
        "--shutdown-grace",
        "--config",
        "KVROUTE_GRPC_ADDR",
        "127.0.0.1:50051",
        "127.0.0.1:9464",
    ] {
        assert!(help.contains(flag), "{flag} missing from help:\n{help}");
    }
}

#[test]
fn sigterm_drains_and_exits_zero() {
    let grpc = format!("127.0.0.1:{}", free_port());
    let metrics = format!("127.0.0.1:{}", free_port());
    let mut child = kvroute()
        .args([
            "serve",
            "--grpc-addr",
            &grpc,
            "--metrics-addr",
            &metrics,
            "--log-format",
            "json",
        ])
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let stderr = child.stderr.take().expect("stderr");
    let mut lines = BufReader::new(stderr).lines();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let line = lines.next().expect("server logs").expect("line");
        if line.contains("kvroute serving") {
            break;
        }
        assert!(Instant::now() < deadline, "server did not start");
    }
    let status = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .expect("kill");
    assert!(status.success());
    let exit = child.wait().expect("wait");
    assert_eq!(exit.code(), Some(0));
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    assert!(
        rest.iter().any(|l| l.contains("kvroute stopped")),
        "{rest:?}"
    );
}

/// A stand-in for `kvroute-tools`: prints its arguments and exits 7.
/// Written once per test process: a test rewriting it while another's
/// kvroute runs it would make that exec fail.
fn fake_tools() -> std::path::PathBuf {
    static PATH: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    PATH.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("kvroute-fake-tools-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("kvroute-tools");
        std::fs::write(&path, "#!/bin/sh\necho \"tools got: $*\"\nexit 7\n").unwrap();
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        path
    })
    .clone()
}

#[test]
fn a_tool_command_runs_kvroute_tools_with_the_same_arguments_and_exit_code() {
    let tools = fake_tools();
    for command in ["replay", "bench", "ctl", "hash"] {
        let output = kvroute()
            .args([command, "--flag", "two words"])
            .env("KVROUTE_TOOLS", &tools)
            .output()
            .unwrap();
        assert_eq!(output.status.code(), Some(7), "{command}");
        assert_eq!(
            String::from_utf8_lossy(&output.stdout).trim(),
            format!("tools got: {command} --flag two words")
        );
    }
}

#[test]
fn serve_never_goes_to_the_tools() {
    let tools = fake_tools();
    let output = kvroute()
        .args(["serve", "--block-size", "0"])
        .env("KVROUTE_TOOLS", &tools)
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&output.stdout).is_empty());
}

#[test]
fn a_missing_tools_binary_is_one_clear_line_and_exit_2() {
    let output = kvroute()
        .args(["replay", "--trace", "x.jsonl"])
        .env("KVROUTE_TOOLS", "/nonexistent/kvroute-tools")
        .output()
        .unwrap();
    assert_eq!(output.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_one_clear_line(&stderr, "/nonexistent/kvroute-tools");
}

#[test]
fn help_names_the_tools() {
    let output = kvroute().arg("--help").output().unwrap();
    assert!(output.status.success());
    let help = String::from_utf8_lossy(&output.stdout);
    for command in ["serve", "replay", "bench", "ctl", "hash"] {
        assert!(help.contains(command), "{command} not in {help}");
    }
}
