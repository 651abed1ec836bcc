// Readiness probe for the local broker (compiled by scripts/kafka.sh against the broker's own
// jars). Exits 0 and prints a one-line summary once the cluster answers with a live broker
// and an active controller; exits 1 otherwise.
import java.util.Collection;
import java.util.Properties;
import org.apache.kafka.clients.admin.Admin;
import org.apache.kafka.clients.admin.AdminClientConfig;
import org.apache.kafka.clients.admin.DescribeClusterResult;
import org.apache.kafka.common.Node;

public class KafkaReady {
    public static void main(String[] args) {
        Properties p = new Properties();
        p.put(AdminClientConfig.BOOTSTRAP_SERVERS_CONFIG, args[0]);
        p.put(AdminClientConfig.REQUEST_TIMEOUT_MS_CONFIG, "5000");
        p.put(AdminClientConfig.DEFAULT_API_TIMEOUT_MS_CONFIG, "5000");
        try (Admin admin = Admin.create(p)) {
            DescribeClusterResult r = admin.describeCluster();
            String cluster = r.clusterId().get();
            Collection<Node> nodes = r.nodes().get();
            Node controller = r.controller().get();
            if (nodes.isEmpty() || controller == null || controller.isEmpty()) {
                System.out.println("no live broker or controller yet");
                System.exit(1);
            }
            System.out.println("cluster " + cluster + ", " + nodes.size() + " broker(s), controller " + controller.id());
        } catch (Exception e) {
            Throwable c = e.getCause() != null ? e.getCause() : e;
            System.out.println(c.getClass().getSimpleName() + ": " + c.getMessage());
            System.exit(1);
        }
    }
}
