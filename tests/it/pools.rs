//! Pool files (`--pool`): engines registered and removed from a file's
//! member list or a DNS name, with no agent calling RegisterWorker, over
//! the real server.

use std::{path::Path, time::Duration};

use kvroute::{config::ServeConfig, pb};

use crate::common::TestServer;

fn pool_file(path: &Path, members: &str) {
    let text = format!(
        "model = \"pooled\"\nhttp_port = 18000\nevents_port = 15557\ndialect = \"vllm\"\n\
         block_size = 16\ntotal_kv_blocks = 1000\n{members}\n"
    );
    // Written aside and renamed: a refresh never reads half a file.
    let aside = path.with_extension("new");
    std::fs::write(&aside, text).unwrap();
    std::fs::rename(&aside, path).unwrap();
}

async fn endpoints(server: &TestServer) -> Vec<String> {
    let mut listed: Vec<String> = server
        .admin()
        .list_workers(pb::ListWorkersRequest::default())
        .await
        .unwrap()
        .into_inner()
        .workers
        .into_iter()
        .map(|w| w.endpoint)
        .collect();
    listed.sort();
    listed
}

async fn until(server: &TestServer, expected: &[&str]) {
    for _ in 0..200 {
        if endpoints(server).await == expected {
            return;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    panic!(
        "members {:?}, expected {expected:?}",
        endpoints(server).await
    );
}

#[tokio::test]
async fn members_come_and_go_with_the_file_and_the_dns_name() {
    let dir = std::env::temp_dir().join(format!("kvroute-pools-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("pool.toml");
    pool_file(&path, "members = [\"127.0.0.1\", \"127.0.0.2\"]");
    let mut config = ServeConfig::for_tests();
    config.gateway.pool = vec![path.clone()];
    config.gateway.pool_refresh_interval = Duration::from_millis(50);
    let server = TestServer::start_with(config).await;
    until(&server, &["127.0.0.1:18000", "127.0.0.2:18000"]).await;
    let info = server
        .worker_info(kvroute::pools::member_id("pooled", "127.0.0.1"))
        .await;
    assert_eq!(info.total_kv_blocks, 1000);
    assert!(
        info.subscription.contains("tcp://127.0.0.1:15557"),
        "{}",
        info.subscription
    );
    // Registering over gRPC under a member's id is refused: it is kvroute's.
    let taken = server
        .workers()
        .register_worker(pb::RegisterWorkerRequest {
            worker_id: info.worker_id,
            model: "pooled".into(),
            block_size: 16,
            ..Default::default()
        })
        .await
        .unwrap_err();
    assert_eq!(taken.code(), tonic::Code::FailedPrecondition, "{taken:?}");

    // One leaves; one outside the allow-list (none given: loopback only)
    // is refused and counted.
    pool_file(&path, "members = [\"127.0.0.1\", \"10.0.0.9\"]");
    until(&server, &["127.0.0.1:18000"]).await;
    let metrics = server.http_get("/metrics").await.1;
    assert!(
        metrics.contains("kvroute_pool_refreshes_total{outcome=\"member_refused\"}"),
        "{metrics}"
    );

    // A file that cannot be read keeps its members.
    std::fs::write(&path, "model = ").unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(endpoints(&server).await, ["127.0.0.1:18000"]);

    // A DNS name: localhost's addresses are the members.
    pool_file(&path, "dns = \"localhost\"");
    for _ in 0..200 {
        let now = endpoints(&server).await;
        if !now.is_empty()
            && now
                .iter()
                .all(|e| e == "127.0.0.1:18000" || e == "[::1]:18000")
            && now.contains(&"127.0.0.1:18000".to_owned())
        {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert!(
        endpoints(&server)
            .await
            .contains(&"127.0.0.1:18000".to_owned())
    );

    // An emptied pool removes everyone, as deregistration does.
    pool_file(&path, "members = []");
    until(&server, &[]).await;
    let _ = std::fs::remove_dir_all(&dir);
}
